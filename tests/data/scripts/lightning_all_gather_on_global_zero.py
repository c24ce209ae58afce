# A LightningModule gathers its test outputs on global rank zero only: the
# other ranks never enter all_gather and rank 0 waits for them forever.
import lightning as L
import torch
import torch.nn.functional as F


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 2)
        self.outputs = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.fc(x), y)

    def test_step(self, batch, batch_idx):
        x, _ = batch
        self.outputs.append(self.fc(x))

    def on_test_epoch_end(self):
        if self.trainer.is_global_zero:
            outputs = self.all_gather(torch.cat(self.outputs))  # expect: collective-mismatch
            print(f"gathered {len(outputs)} predictions")

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters())
