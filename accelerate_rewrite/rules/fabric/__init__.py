"""The Fabric plan (where Fabric goes, what is set up, what runs on rank 0) and the rules that write it."""
