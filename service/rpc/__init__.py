"""The gRPC front end: servicers over the serving layer (front.py), proto <-> domain translation (wire.py)."""
