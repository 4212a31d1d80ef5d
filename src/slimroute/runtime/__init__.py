"""The model on this CPU: CPU facts and dtype policy, loading (packaged models, cache paths, threads), the linear and
attention kernels, int8 (quantisation, smoothing, the compact output head) and the model's fingerprint."""
