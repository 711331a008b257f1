"""Shim of nanochat.optim: gpt.py imports the optimizers; the tests never train."""


class MuonAdamW:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("the vendored reference does not train")


DistMuonAdamW = MuonAdamW
