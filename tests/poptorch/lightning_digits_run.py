"""Run by ``test_lightning.py`` in a fresh process: lightning-graphcore's IPUStrategy
on the IPU Model (``POPTORCH_IPU_MODEL_AS_HARDWARE=1``) and a plain Lightning CPU run
train, validate and predict the digits CNN of ``examples/digits.py`` from the same
initial weights; the script prints one JSON line comparing them."""
import json
import os
import pathlib
import sys
import warnings

os.environ["POPTORCH_IPU_MODEL_AS_HARDWARE"] = "1"  # before lightning_graphcore imports
warnings.filterwarnings("ignore")  # Lightning's own notes are not under test here

import torch  # noqa: E402

torch.set_num_threads(1)  # a tiny model: see README "Threads"

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
import digits  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
from lightning_graphcore import IPUAccelerator, IPUPrecision, IPUStrategy  # noqa: E402


class LitDigits(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = digits.DigitsCNN()

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return self.model(images, labels)[1]

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        return (self.model(images).argmax(dim=1) == labels).float().mean()

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self.log("val_acc", outputs.mean())

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return self.model(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def run(on_ipu: bool):
    train_set, test_set = digits.load_data()
    train = torch.utils.data.DataLoader(torch.utils.data.Subset(train_set, range(256)),
                                        batch_size=16)
    test = torch.utils.data.DataLoader(torch.utils.data.Subset(test_set, range(64)),
                                       batch_size=16)
    torch.manual_seed(0)
    module = LitDigits()
    common = dict(max_epochs=2, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False,
                  num_sanity_val_steps=0)
    if on_ipu:
        trainer = pl.Trainer(accelerator=IPUAccelerator(), devices=1,
                             strategy=IPUStrategy(), plugins=[IPUPrecision("32-true")],
                             **common)
    else:
        trainer = pl.Trainer(accelerator="cpu", devices=1, **common)
    trainer.fit(module, train, test)
    metrics = trainer.validate(module, test, verbose=False)
    predictions = torch.cat(trainer.predict(module, test))
    return module, metrics, predictions, type(trainer.strategy).__name__


ipu, cpu = run(True), run(False)
print(json.dumps({
    "strategies": [ipu[3], cpu[3]],
    "weight_difference": max(float((a - b).abs().max()) for a, b in
                             zip(ipu[0].state_dict().values(), cpu[0].state_dict().values())),
    "weights_moved": not torch.equal(ipu[0].model.classifier.weight,
                                     LitDigits().model.classifier.weight),
    "validate": [ipu[1], cpu[1]],
    "prediction_shape": list(ipu[2].shape),
    "prediction_difference": float((ipu[2] - cpu[2]).abs().max()),
}))
