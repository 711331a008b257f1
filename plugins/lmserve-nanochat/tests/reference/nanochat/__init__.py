"""nanochat's model code (vendored, MIT: see ../LICENSE.nanochat) and shims of the modules it
imports, as the reference of lmserve-nanochat's tests."""
