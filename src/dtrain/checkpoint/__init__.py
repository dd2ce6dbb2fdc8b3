"""Checkpoints that a crash cannot corrupt and any layout can read.

- `dtrain.checkpoint.atomic`: files written atomically with checksums, and the list of a
  folder's checkpoints (`index.json` of the checkpoints folder).
- `dtrain.checkpoint.universal`: the layout-free format (logical tensors in pieces, one
  `index.json` per checkpoint) and `export` to one plain state_dict.
- `dtrain.checkpoint.fallback`: a resume takes the newest checkpoint that verifies; the
  damaged ones are moved into `damaged/`, never deleted.
- `dtrain.checkpoint.training`: what `dtrain train` saves and how it resumes.
- `dtrain.checkpoint.checkpointable`: `Checkpointable`, what a way of holding a model
  gives the checkpoint code (every dtrain.layouts Holding is one).
- `dtrain.checkpoint.background`: saves written by a thread while training goes on.
- `dtrain.checkpoint.copies`: hosts without a shared filesystem (`checkpoint.copies`):
  each writes its own folder and copies it to others; resume fetches what a host lacks,
  or holds damaged, from any host that holds a good copy.
- `dtrain.checkpoint.live_copies`: the same between live replicas' hosts: the replica
  that writes a checkpoint sends it whole to other hosts' keepers.
- `dtrain.checkpoint.transfer`: files and JSON between ranks over a process group (or two
  processes of no common group).
"""
