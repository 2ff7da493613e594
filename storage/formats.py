"""The store's user-facing format choices and quantization constants, without torch: the element
types `store import --dtype` casts to, int4's group sizes, int8's code range and the rows quantized
at once. `storage.dtypes` and `storage.quant` (which import torch) take
them from here, so that the command line can offer them before anything heavy loads."""

CAST_CHOICES = ("keep", "float32", "bfloat16", "float16")  # the names users give on the command line (--dtype)
INT4_GROUP_SIZES = (32, 64, 128, 256)
INT4_DEFAULT_GROUP = 128
INT8_MAX = 127  # int8 codes lie in [-127, 127], one scale per output row
# Rows quantized at once: bounds the float32 temporaries (a 32000-row lm_head took four copies of
# itself, 0.5 GB, when quantized whole); a multiple of int4's 64-row blocks
QUANTIZE_ROWS = 512
