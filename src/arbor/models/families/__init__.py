"""The built-in model families (arbor.models.family.ModelFamily), one small torch-free file each; listed by
architecture name in arbor.registry.MODEL_FAMILIES."""
