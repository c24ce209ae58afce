"""An Accelerate fine-tuning script: the periodic checkpoint is saved on the
main process, but the final export runs on every process and writes the same
files into one folder at once."""

import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM


def main():
    accelerator = Accelerator()
    model = AutoModelForCausalLM.from_pretrained("gpt2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    for step in range(1000):
        ids = torch.randint(0, 50257, (4, 64), device=accelerator.device)
        accelerator.backward(model(ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()
        if step % 500 == 0 and accelerator.is_main_process:
            accelerator.unwrap_model(model).save_pretrained(f"out/step_{step}")
    accelerator.wait_for_everyone()
    final = accelerator.unwrap_model(model)
    final.save_pretrained("out/final")  # expect: checkpoint-written-by-every-rank


if __name__ == "__main__":
    main()
