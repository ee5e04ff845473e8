"""Rollfleet's engine package: what runs next to vLLM in every engine pod.

Modules: ``server`` (launcher), ``access`` + ``middleware`` (token-checked control
routes), ``tracker`` + ``abort`` + ``engine_hooks`` (abort by caller id that tells the
truth), ``http_backend`` + ``weights_server`` + ``safetensors_stream`` (portable weight
updates), ``staging`` + ``mappings`` + ``pinning`` (the next weights prefetched into memory
while serving, loaded in the pause), ``collective_backend`` (gloo and nccl), ``tiny_model``
(test model), ``protocol`` (HTTP bodies; imports neither vLLM nor torch, for the gateway and
operator).
"""

__version__ = "0.1.0"
