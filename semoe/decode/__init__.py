"""The CPU decoding core: what each path takes (`support`) and the step as a plan of kernel calls
(`plan`); the kernels themselves are in semoe/kernels, loaded by `semoe.kernel_abi`."""
