"""Pure math of verlite: losses, advantages, batching and metrics.

Modules here import only torch (never ray, torch.distributed or config classes), so the
normalization contract can be read and tested without any runtime around it.
"""
