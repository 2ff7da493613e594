"""The store's user-facing format choices, without torch: the element types `store import --dtype`
casts to and int4's group sizes. `storage.dtypes` and `storage.quant` (which import torch) take
them from here, so that the command line can offer them before anything heavy loads."""

CAST_CHOICES = ("keep", "float32", "bfloat16", "float16")  # the names users give on the command line (--dtype)
INT4_GROUP_SIZES = (32, 64, 128, 256)
INT4_DEFAULT_GROUP = 128
