"""The engine: requests, sequences, scheduling, the model runner and sampling."""
