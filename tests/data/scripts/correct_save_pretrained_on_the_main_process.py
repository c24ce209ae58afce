"""The final export on the main process only, and Hugging Face's own guard
(is_main_process=) for the other save."""

import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM


def main():
    accelerator = Accelerator()
    model = AutoModelForCausalLM.from_pretrained("gpt2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    for _ in range(1000):
        ids = torch.randint(0, 50257, (4, 64), device=accelerator.device)
        accelerator.backward(model(ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()
    accelerator.wait_for_everyone()
    final = accelerator.unwrap_model(model)
    final.save_pretrained(
        "out/final", is_main_process=accelerator.is_main_process, save_function=accelerator.save
    )
    if accelerator.is_main_process:
        final.save_pretrained("out/copy")


if __name__ == "__main__":
    main()
