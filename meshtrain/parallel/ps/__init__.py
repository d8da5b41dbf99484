"""Parameter-server training over torch.distributed.rpc: the servers (``server``), the worker
side (``client``) and the ``ps`` layout behind the Trainer (``layout``)."""
