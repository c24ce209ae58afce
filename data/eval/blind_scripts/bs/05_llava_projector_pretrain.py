"""LLaVA stage-1: train only the vision->language projector on caption pairs.

Vision tower (CLIP ViT-L/14-336) and the LLM are frozen; the projector is a
2-layer MLP (mlp2x_gelu).  Data: LLaVA-Pretrain blip_laion_cc_sbu_558k.json.

    torchrun --nproc_per_node=8 05_llava_projector_pretrain.py \
        --llm lmsys/vicuna-7b-v1.5 --data blip_laion_cc_sbu_558k.json --image-folder images/
"""
import argparse
import copy
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForCausalLM, AutoTokenizer, CLIPImageProcessor,
                          CLIPVisionModel, get_cosine_schedule_with_warmup)

IGNORE_INDEX = -100
IMAGE_TOKEN = "<image>"


class PretrainDataset(Dataset):
    def __init__(self, path, image_folder, tokenizer, image_processor, max_len=512):
        with open(path) as f:
            self.items = json.load(f)
        self.image_folder = image_folder
        self.tok = tokenizer
        self.proc = image_processor
        self.max_len = max_len

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        item = self.items[i]
        image = Image.open(os.path.join(self.image_folder, item["image"])).convert("RGB")
        pixel_values = self.proc(image, return_tensors="pt")["pixel_values"][0]
        caption = item["conversations"][1]["value"]
        # plain template: <image>\n caption </s>; loss only on the caption
        ids = self.tok(caption + self.tok.eos_token, add_special_tokens=False,
                       truncation=True, max_length=self.max_len).input_ids
        return pixel_values, torch.tensor(ids)


def collate(batch, pad_id):
    pixel_values, ids = zip(*batch)
    L = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), L), pad_id, dtype=torch.long)
    labels = torch.full((len(ids), L), IGNORE_INDEX, dtype=torch.long)
    attn = torch.zeros((len(ids), L), dtype=torch.long)
    for i, x in enumerate(ids):
        input_ids[i, :len(x)] = x
        labels[i, :len(x)] = x
        attn[i, :len(x)] = 1
    return torch.stack(pixel_values), input_ids, labels, attn


class LlavaForPretrain(nn.Module):
    def __init__(self, vision_tower, llm, select_layer=-2):
        super().__init__()
        self.vision_tower = vision_tower
        self.llm = llm
        self.select_layer = select_layer
        vd = vision_tower.config.hidden_size
        ld = llm.config.hidden_size
        self.mm_projector = nn.Sequential(nn.Linear(vd, ld), nn.GELU(), nn.Linear(ld, ld))

    @torch.no_grad()
    def encode_images(self, pixel_values):
        out = self.vision_tower(pixel_values, output_hidden_states=True)
        feats = out.hidden_states[self.select_layer][:, 1:]  # drop CLS
        return feats

    def forward(self, pixel_values, input_ids, labels, attention_mask):
        img_feats = self.encode_images(pixel_values.to(self.vision_tower.dtype))
        img_embeds = self.mm_projector(img_feats.to(self.mm_projector[0].weight.dtype))
        tok_embeds = self.llm.get_input_embeddings()(input_ids.to(self.llm.device))
        img_embeds = img_embeds.to(tok_embeds.dtype)
        inputs_embeds = torch.cat([img_embeds, tok_embeds], dim=1)
        n_img = img_embeds.shape[1]
        img_labels = torch.full((labels.shape[0], n_img), IGNORE_INDEX, dtype=labels.dtype, device=labels.device)
        img_mask = torch.ones((labels.shape[0], n_img), dtype=attention_mask.dtype, device=attention_mask.device)
        out = self.llm(inputs_embeds=inputs_embeds,
                       attention_mask=torch.cat([img_mask, attention_mask], 1),
                       labels=torch.cat([img_labels, labels], 1))
        return out.loss


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llm", default="lmsys/vicuna-7b-v1.5")
    ap.add_argument("--vision-tower", default="openai/clip-vit-large-patch14-336")
    ap.add_argument("--data", required=True)
    ap.add_argument("--image-folder", required=True)
    ap.add_argument("--output-dir", default="checkpoints/llava-v1.5-7b-pretrain")
    ap.add_argument("--per-device-batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--warmup-ratio", type=float, default=0.03)
    ap.add_argument("--save-steps", type=int, default=2000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tokenizer = AutoTokenizer.from_pretrained(args.llm, use_fast=False)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.unk_token
    image_processor = CLIPImageProcessor.from_pretrained(args.vision_tower)

    vision_tower = CLIPVisionModel.from_pretrained(args.vision_tower, torch_dtype=torch.bfloat16).to(device)
    vision_tower.requires_grad_(False)
    llm = AutoModelForCausalLM.from_pretrained(args.llm, torch_dtype=torch.bfloat16, device_map="auto")
    llm.requires_grad_(False)
    llm.config.use_cache = False

    model = LlavaForPretrain(vision_tower, llm)
    model.mm_projector.to(device)
    model = DDP(model, device_ids=[local_rank])

    ds = PretrainDataset(args.data, args.image_folder, tokenizer, image_processor)
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=args.per_device_batch, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True,
                        collate_fn=lambda b: collate(b, tokenizer.pad_token_id))

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    total = len(loader) * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total), total)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        n_train = sum(p.numel() for p in trainable)
        print(f"trainable params: {n_train / 1e6:.1f}M, world size {world_size}, steps {total}")

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for pixel_values, input_ids, labels, attn in loader:
            pixel_values = pixel_values.to(device, non_blocking=True)
            input_ids, labels, attn = input_ids.to(device), labels.to(device), attn.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(pixel_values, input_ids, labels, attn)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                l = loss.detach().float()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step}/{total} loss {l.item():.4f} lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
            if step % args.save_steps == 0 and rank == 0:
                torch.save(model.module.mm_projector.state_dict(),
                           os.path.join(args.output_dir, f"mm_projector_step{step}.bin"))

    if rank == 0:
        torch.save(model.module.mm_projector.state_dict(), os.path.join(args.output_dir, "mm_projector.bin"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
