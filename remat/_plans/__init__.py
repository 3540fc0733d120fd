"""From a call to a plan: the plan cache, shape templates, sharing one plan between regions. Imports the layers below."""
