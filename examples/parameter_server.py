"""Parameter-server training on scikit-learn's handwritten digits, in one file.

    dtrain run -n 2 --servers 1 examples/parameter_server.py                  # sync
    dtrain run -n 2 --servers 2 examples/parameter_server.py --consistency ssp --staleness 2
    dtrain run -n 4 --servers 1 examples/parameter_server.py --consistency async
    dtrain run -n 2 --servers 2 examples/parameter_server.py --copies 2        # backups
    dtrain run -n 2 --servers 3 examples/parameter_server.py --copies 3        # two each

`dtrain run` starts the servers (dtrain's own loop: no code of yours) and the workers,
which run this script. Worker 0 seeds the servers with its model and the settings; each
worker trains on its own part of the data, pushing gradients and pulling parameters.
`--die-at-step N` makes worker 1 kill itself there (SIGKILL), to watch the job go on;
with `--copies 2` each shard has a backup on another server, so a server may die too
(`DTRAIN_FAULT=kill@push=20,rank=0` kills server 0 as its 20th clock's push arrives): its
launcher starts a new server 0, which copies its shards from their live copies and joins
their chains while the workers go on, so the next death is survived too.
Needs scikit-learn for the data (`pip install scikit-learn`).
"""

import argparse
import os
import signal

import torch
from sklearn.datasets import load_digits
from torch import nn

import dtrain
from dtrain import ps

parser = argparse.ArgumentParser()
parser.add_argument("--consistency", default="sync", choices=ps.CONSISTENCY)
parser.add_argument("--staleness", type=int, default=0)
parser.add_argument("--epochs", type=int, default=8)
parser.add_argument("--worker-timeout", type=float, default=120.0)
parser.add_argument("--die-at-step", type=int, default=0)
parser.add_argument("--copies", type=int, default=1)
args = parser.parse_args()

world = dtrain.init()                            # role "worker"; rank among the workers
digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32) / 16
y = torch.tensor(digits.target)
order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
train, test = order[:1400], order[1400:]
mine = train[world.rank :: world.world_size]     # this worker's part of the data

torch.manual_seed(1)
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
worker = ps.Worker(model, ps.Settings(args.consistency, args.staleness, optimizer="sgd", lr=0.1,
                                      momentum=0.9, worker_timeout=args.worker_timeout,
                                      copies=args.copies))
worker.start()
step = 0
for epoch in range(args.epochs):
    shuffle = torch.Generator().manual_seed(epoch * 100 + world.rank)
    for idx in mine[torch.randperm(len(mine), generator=shuffle)].split(25):
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        worker.step()                            # push gradients, pull parameters
        step += 1
        if step == args.die_at_step and world.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
worker.close()
with torch.no_grad():
    accuracy = (model(x[test]).argmax(1) == y[test]).float().mean().item()
print(f"{world.role} {world.rank}: test accuracy {accuracy:.3f} after {step} steps "
      f"({args.consistency}, {worker.sent_bytes / 1e6:.1f} MB pushed)")
