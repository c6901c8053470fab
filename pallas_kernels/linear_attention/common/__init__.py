"""Pieces both chunked ops share: tiles and checks (tiles.py), the output
kernel (output.py), the key-side gradient pieces (key_side.py), the Mosaic GPU
passes (mosaic.py), the one-token step kernel (step.py), the references'
helpers (naive.py) and the dense-tile range scan (numerics.py)."""
