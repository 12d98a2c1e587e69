"""Front end: the model as an ATen-level torch.fx graph (torch.export), repeated blocks copied, opaque submodules kept whole."""
