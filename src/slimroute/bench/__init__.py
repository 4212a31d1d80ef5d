"""`slimroute bench`: the speed rows (the seed experiment, every dtype), the accuracy rows, and llama.cpp as a peer."""
