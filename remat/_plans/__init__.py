"""From a call to a plan: the plan cache, shape templates, sharing one plan between regions, like layers taking a traced layer's plan. Imports the layers below."""
