"""dtrain.ps: parameter servers and workers, with sync, async and bounded-staleness training.

Servers hold the parameters (each a contiguous shard of the flat vector) and their
optimizer state, and apply updates; workers pull parameters, compute gradients on their
data and push them (`server`, `worker`), under the rules of `Settings`. Messages are JSON
headers, HMAC-signed, with raw tensor bytes (`wire`); nothing received is unpickled.
`dtrain run -n W --servers S` starts a whole job (`job`).
"""

from dtrain.ps.optimizer import RemoteOptimizer
from dtrain.ps.server import Answered, Server
from dtrain.ps.settings import CONSISTENCY, Settings
from dtrain.ps.wire import BadMessage, Message, pack, unpack
from dtrain.ps.worker import Worker

__all__ = ["CONSISTENCY", "Answered", "BadMessage", "Message", "RemoteOptimizer", "Server",
           "Settings", "Worker", "pack", "unpack"]
