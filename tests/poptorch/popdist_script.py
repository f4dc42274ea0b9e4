"""A PopDist-style training script (unchanged PopTorch + PopDist code), run by the
tests under ``poprun`` and ``torchrun``. Writes ``<out_dir>/rank<i>.pt``."""
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import popdist
import popdist.poptorch
import poptorch


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, t):
        out = self.fc(x)
        return out, F.cross_entropy(out, t)


def main(out_dir):
    if popdist.isPopdistEnvSet():
        popdist.init()
    opts = popdist.poptorch.Options()
    opts.deviceIterations(2)
    opts.randomSeed(0)
    torch.manual_seed(popdist.getInstanceIndex())  # weights differ until broadcast
    model = Net()
    gen = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(48, 4, generator=gen),
                                          torch.randint(0, 3, (48,), generator=gen))
    loader = poptorch.DataLoader(opts, data, batch_size=2)
    training = poptorch.trainingModel(model, opts, poptorch.optim.SGD(
        model.parameters(), lr=0.1))
    inputs = []
    for x, t in loader:
        inputs.append((x.clone(), t.clone()))
        training(x, t)
    torch.save({"inputs": inputs,
                "state": {k: v.clone() for k, v in model.state_dict().items()},
                "index": popdist.getInstanceIndex(),
                "instances": popdist.getNumInstances(),
                "local": popdist.getNumLocalReplicas(),
                "total": popdist.getNumTotalReplicas(),
                "offset": popdist.getReplicaIndexOffset()},
               os.path.join(out_dir, f"rank{popdist.getInstanceIndex()}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
