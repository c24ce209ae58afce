"""Textual inversion with Accelerate: the text encoder, known as a module only
by what the script asks of it (train(), its input embeddings), is prepared, so
under several processes it is the DDP wrapper, which has no
get_input_embeddings."""

import torch
from accelerate import Accelerator
from transformers import CLIPTextModel


def main():
    accelerator = Accelerator()
    text_encoder = CLIPTextModel.from_pretrained("openai/clip-vit-large-patch14")
    optimizer = torch.optim.AdamW(text_encoder.get_input_embeddings().parameters(), lr=1e-4)
    original = text_encoder.get_input_embeddings().weight.data.clone()
    text_encoder, optimizer = accelerator.prepare(text_encoder, optimizer)
    text_encoder.train()
    for _ in range(100):
        ids = torch.randint(0, 49408, (4, 77), device=accelerator.device)
        loss = text_encoder(ids).last_hidden_state.mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            text_encoder.get_input_embeddings().weight[:-1] = original[:-1]  # expect: ddp-wrapper-attribute


if __name__ == "__main__":
    main()
