"""The face: the decorator, checkpoint_name, checkpoint_layers, reports, comparing and measuring. remat/__init__.py hands its names on."""
