# Saving a checkpoint with Accelerate: wait_for_everyone() sits inside the
# main-process block, so only rank 0 waits there and the job hangs.
import os

import torch
from accelerate import Accelerator

accelerator = Accelerator()
model = torch.nn.Linear(8, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.DataLoader(torch.randn(64, 8), batch_size=8)
model, optimizer, data = accelerator.prepare(model, optimizer, data)

for step, batch in enumerate(data):
    loss = model(batch).sum()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    if accelerator.sync_gradients and accelerator.is_main_process and step % 4 == 0:
        accelerator.wait_for_everyone()  # expect: collective-mismatch
        state = accelerator.unwrap_model(model).state_dict()
        torch.save(state, os.path.join("checkpoints", f"step-{step}.pt"))
