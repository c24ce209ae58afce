# Accelerate and Lightning collectives called by every rank; only printing,
# saving and torch.gather (a tensor op, not a collective) are rank-0 only.
import lightning as L
import torch
from accelerate import Accelerator

accelerator = Accelerator()
model = accelerator.prepare(torch.nn.Linear(8, 2))
predictions = accelerator.gather_for_metrics(model(torch.randn(4, 8)))
accelerator.wait_for_everyone()
if accelerator.is_main_process:
    picked = torch.gather(predictions, 1, torch.zeros(len(predictions), 1, dtype=torch.long))
    accelerator.save(accelerator.unwrap_model(model).state_dict(), "model.pt")
    print(picked.shape)


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 2)

    def on_validation_epoch_end(self):
        scores = self.all_gather(self.fc.weight.sum())
        self.trainer.strategy.barrier()
        if self.trainer.is_global_zero:
            print(f"mean score {scores.mean():.3f}")
