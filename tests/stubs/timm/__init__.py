"""A stand-in for timm in the tests (timm needs torchvision, which the CPU build of torch on the
test machines can't import): the two APIs codemod/analysis/libraries.py describes, written from their
documented behaviour, doing what timm's do."""
