"""LLaVA-style stage 1: feature alignment.

Frozen CLIP ViT-L/14-336 and frozen Vicuna-7B, only the 2-layer MLP projector is trained
on LCS-558K (image, caption) pairs.  Resumable from the last projector checkpoint.

    torchrun --nproc_per_node=8 03_llava_pretrain_projector.py \
        --data /data/LLaVA-Pretrain/blip_laion_cc_sbu_558k.json --image-folder /data/LLaVA-Pretrain/images \
        --output-dir ./checkpoints/llava-v1.5-7b-pretrain --resume ./checkpoints/llava-v1.5-7b-pretrain/last.pt
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, CLIPImageProcessor, CLIPVisionModel, LlamaForCausalLM

IGNORE_INDEX = -100
IMAGE_TOKEN = "<image>"


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--llm", default="lmsys/vicuna-7b-v1.5")
    p.add_argument("--vision-tower", default="openai/clip-vit-large-patch14-336")
    p.add_argument("--data", required=True)
    p.add_argument("--image-folder", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--resume", default=None)
    p.add_argument("--per-device-batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-ratio", type=float, default=0.03)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--num-workers", type=int, default=4)
    return p.parse_args()


class PretrainDataset(Dataset):
    """LCS-558K: conversations are [{"from": "human", "value": "<image>\n..."}, {"from": "gpt", "value": caption}]."""

    def __init__(self, path, image_folder, tokenizer, processor, max_len):
        self.items = json.load(open(path))
        self.image_folder = image_folder
        self.tok = tokenizer
        self.proc = processor
        self.max_len = max_len

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        image = Image.open(os.path.join(self.image_folder, it["image"])).convert("RGB")
        pixel_values = self.proc(image, return_tensors="pt")["pixel_values"][0]
        caption = it["conversations"][1]["value"]
        # plain template: <image> caption </s>, loss on the caption only
        cap_ids = self.tok(caption + self.tok.eos_token, add_special_tokens=False).input_ids[: self.max_len - 2]
        input_ids = [self.tok.bos_token_id, -200] + cap_ids
        labels = [IGNORE_INDEX, IGNORE_INDEX] + cap_ids
        return pixel_values, torch.tensor(input_ids), torch.tensor(labels)


def collate(batch, pad_id):
    pix = torch.stack([b[0] for b in batch])
    ids = nn.utils.rnn.pad_sequence([b[1] for b in batch], batch_first=True, padding_value=pad_id)
    labels = nn.utils.rnn.pad_sequence([b[2] for b in batch], batch_first=True, padding_value=IGNORE_INDEX)
    return pix, ids, labels, ids.ne(pad_id)


class LlavaAligner(nn.Module):
    def __init__(self, vision_tower, llm):
        super().__init__()
        self.vision_tower = vision_tower
        self.llm = llm
        vd, ld = vision_tower.config.hidden_size, llm.config.hidden_size
        self.mm_projector = nn.Sequential(nn.Linear(vd, ld), nn.GELU(), nn.Linear(ld, ld))

    def encode_images(self, pixel_values):
        with torch.no_grad():
            out = self.vision_tower(pixel_values.to(self.vision_tower.dtype), output_hidden_states=True)
            feats = out.hidden_states[-2][:, 1:]  # penultimate layer, drop CLS
        return self.mm_projector(feats.float())

    def forward(self, pixel_values, input_ids, labels, attention_mask):
        img = self.encode_images(pixel_values)             # B, 576, D
        embed = self.llm.get_input_embeddings()
        embeds, new_labels, new_masks = [], [], []
        for b in range(input_ids.size(0)):
            pos = (input_ids[b] == -200).nonzero()[0, 0]
            ids = input_ids[b].clone()
            ids[pos] = 0
            tok = embed(ids)
            embeds.append(torch.cat([tok[:pos], img[b].to(tok.dtype), tok[pos + 1:]]))
            new_labels.append(torch.cat([labels[b, :pos], labels.new_full((img.size(1),), IGNORE_INDEX), labels[b, pos + 1:]]))
            new_masks.append(torch.cat([attention_mask[b, :pos], attention_mask.new_ones(img.size(1)), attention_mask[b, pos + 1:]]))
        return self.llm(inputs_embeds=torch.stack(embeds), attention_mask=torch.stack(new_masks),
                        labels=torch.stack(new_labels)).loss


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    tokenizer = AutoTokenizer.from_pretrained(args.llm, use_fast=False)
    tokenizer.pad_token = tokenizer.unk_token
    processor = CLIPImageProcessor.from_pretrained(args.vision_tower)

    llm = LlamaForCausalLM.from_pretrained(args.llm, torch_dtype=torch.bfloat16)
    vision = CLIPVisionModel.from_pretrained(args.vision_tower, torch_dtype=torch.bfloat16)
    llm.requires_grad_(False)
    vision.requires_grad_(False)
    model = LlavaAligner(vision, llm).to(device)
    model = DDP(model, device_ids=[local_rank])

    ds = PretrainDataset(args.data, args.image_folder, tokenizer, processor, args.max_len)
    sampler = DistributedSampler(ds, shuffle=True, seed=42)
    loader = DataLoader(ds, batch_size=args.per_device_batch_size, sampler=sampler, num_workers=args.num_workers,
                        collate_fn=lambda b: collate(b, tokenizer.pad_token_id), pin_memory=True)

    projector = model.module.mm_projector
    opt = torch.optim.AdamW(projector.parameters(), lr=args.lr, weight_decay=0.0)
    total = len(loader) * args.epochs
    warmup = int(total * args.warmup_ratio)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / max(1, warmup) if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, total - warmup))))

    step, start_epoch, skip = 0, 0, 0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume)
        projector.load_state_dict(ckpt["mm_projector"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        step = ckpt["step"]
        start_epoch, skip = divmod(step, len(loader))
        if rank == 0:
            print(f"resumed from {args.resume} at step {step}", flush=True)

    os.makedirs(args.output_dir, exist_ok=True)

    def save(path):
        torch.save({"mm_projector": projector.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(), "step": step}, path)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (pix, ids, labels, mask) in enumerate(loader):
            if epoch == start_epoch and i < skip:
                continue
            pix, ids, labels, mask = (t.to(device, non_blocking=True) for t in (pix, ids, labels, mask))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(pix, ids, labels, mask)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(projector.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step}/{total} loss {l.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                          f"{(time.time() - t0) / 10:.2f}s/it", flush=True)
                    t0 = time.time()
            if step % args.save_every == 0:
                if rank == 0:
                    save(os.path.join(args.output_dir, "last.pt"))
                dist.barrier()

    if rank == 0:
        save(os.path.join(args.output_dir, "last.pt"))
        torch.save(projector.state_dict(), os.path.join(args.output_dir, "mm_projector.bin"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
