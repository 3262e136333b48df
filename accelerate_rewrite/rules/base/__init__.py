"""What every rule builds on: the Fabric plan's data and code snippets, calls' keywords, half precision and apex facts."""
