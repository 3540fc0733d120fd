"""Running a plan: the autograd.Function, chaining regions, the first-run layout check, the code later runs use. Imports the layers below."""
