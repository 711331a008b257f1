"""nanochat's model code and inference engine (vendored, MIT: see ../LICENSE.nanochat) and
shims of the modules they import, as the reference of lmserve-nanochat's tests."""
