# Stage-2 instruction tuning of our small VLM (SigLIP-so400m + Qwen2-1.5B) on the
# llava_v1_5_mix665k mixture. The mixture contains text-only ShareGPT conversations;
# batches are grouped by modality like upstream LLaVA so that image and text
# samples are not padded against each other.
#
#   torchrun --nproc_per_node=8 04_stage2_mix665k_ddp.py --data mix665k.json --image_root /data/llava
import argparse
import functools
import json
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from transformers import (AutoModelForCausalLM, AutoTokenizer, SiglipImageProcessor, SiglipVisionModel,
                          get_cosine_schedule_with_warmup)

IGNORE = -100
IMG_PLACEHOLDER = "<image>"


def args_():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llm", default="Qwen/Qwen2-1.5B-Instruct")
    ap.add_argument("--vision", default="google/siglip-so400m-patch14-384")
    ap.add_argument("--projector", default="checkpoints/stage1/projector.pt")
    ap.add_argument("--data", required=True)
    ap.add_argument("--image_root", required=True)
    ap.add_argument("--out", default="checkpoints/stage2")
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--save_every", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1234)
    return ap.parse_args()


def encode_conversation(conv, tok, max_len):
    """Qwen chat template; only assistant turns are supervised."""
    ids, labels = [], []
    for turn in conv:
        role = "user" if turn["from"] == "human" else "assistant"
        text = turn["value"].replace(IMG_PLACEHOLDER, "").strip()
        piece = tok(f"<|im_start|>{role}\n{text}<|im_end|>\n", add_special_tokens=False).input_ids
        ids += piece
        labels += piece if role == "assistant" else [IGNORE] * len(piece)
    return ids[:max_len], labels[:max_len]


class MixDataset(Dataset):
    def __init__(self, path, image_root, tok, proc, max_len):
        self.rows = json.load(open(path))
        self.image_root, self.tok, self.proc, self.max_len = image_root, tok, proc, max_len
        self.has_image = ["image" in r for r in self.rows]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        ids, labels = encode_conversation(r["conversations"], self.tok, self.max_len)
        out = {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels), "pixel_values": None}
        if "image" in r:
            img = Image.open(os.path.join(self.image_root, r["image"])).convert("RGB")
            out["pixel_values"] = self.proc(img, return_tensors="pt")["pixel_values"][0]
        return out


class ModalityGroupedSampler(Sampler):
    """Each global batch (bs * world_size samples) is all-image or all-text; rank r takes its slice."""

    def __init__(self, has_image, bs, world_size, rank, seed=0):
        self.has_image, self.bs, self.world, self.rank, self.seed = has_image, bs, world_size, rank, seed
        self.epoch = 0
        mega = bs * world_size
        self.n_batches = sum(h for h in has_image) // mega + sum(not h for h in has_image) // mega

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        img = [i for i, h in enumerate(self.has_image) if h]
        txt = [i for i, h in enumerate(self.has_image) if not h]
        img = [img[j] for j in torch.randperm(len(img), generator=g)]
        txt = [txt[j] for j in torch.randperm(len(txt), generator=g)]
        mega = self.bs * self.world
        chunks = [img[k:k + mega] for k in range(0, len(img) - mega + 1, mega)]
        chunks += [txt[k:k + mega] for k in range(0, len(txt) - mega + 1, mega)]
        order = torch.randperm(len(chunks), generator=g).tolist()
        for c in order:
            yield from chunks[c][self.rank * self.bs:(self.rank + 1) * self.bs]

    def __len__(self):
        return self.n_batches * self.bs


def collate(batch, pad_id):
    ids = nn.utils.rnn.pad_sequence([b["input_ids"] for b in batch], batch_first=True, padding_value=pad_id)
    labels = nn.utils.rnn.pad_sequence([b["labels"] for b in batch], batch_first=True, padding_value=IGNORE)
    pix = [b["pixel_values"] for b in batch if b["pixel_values"] is not None]
    return {"input_ids": ids, "labels": labels, "attention_mask": ids.ne(pad_id).long(),
            "pixel_values": torch.stack(pix) if pix else None}


class TinyLlava(nn.Module):
    def __init__(self, llm, vision):
        super().__init__()
        self.llm, self.vision = llm, vision
        d = llm.config.hidden_size
        self.projector = nn.Sequential(nn.Linear(vision.config.hidden_size, d), nn.GELU(), nn.Linear(d, d))

    def forward(self, input_ids, attention_mask, labels, pixel_values=None):
        embeds = self.llm.get_input_embeddings()(input_ids)
        if pixel_values is not None:
            with torch.no_grad():
                feats = self.vision(pixel_values.to(self.vision.dtype)).last_hidden_state
            img = self.projector(feats.float()).to(embeds.dtype)
            embeds = torch.cat([img, embeds], dim=1)
            attention_mask = torch.cat([attention_mask.new_ones(img.shape[:2]), attention_mask], 1)
            labels = torch.cat([labels.new_full(img.shape[:2], IGNORE), labels], 1)
        return self.llm(inputs_embeds=embeds, attention_mask=attention_mask, labels=labels)


def main():
    a = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    random.seed(a.seed)
    np.random.seed(a.seed)
    torch.manual_seed(a.seed)
    dev = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(a.llm)
    proc = SiglipImageProcessor.from_pretrained(a.vision)
    llm = AutoModelForCausalLM.from_pretrained(a.llm, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    vision = SiglipVisionModel.from_pretrained(a.vision, torch_dtype=torch.bfloat16).requires_grad_(False)
    model = TinyLlava(llm, vision)
    model.projector.load_state_dict(torch.load(a.projector, map_location="cpu"))
    model.to(dev)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    ds = MixDataset(a.data, a.image_root, tok, proc, a.max_len)
    sampler = ModalityGroupedSampler(ds.has_image, a.bs, world, rank, seed=a.seed)
    loader = DataLoader(ds, batch_size=a.bs, sampler=sampler, num_workers=8, pin_memory=True,
                        collate_fn=functools.partial(collate, pad_id=tok.pad_token_id), drop_last=True)

    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.0}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, fused=True)
    total = a.epochs * len(loader)
    sched = get_cosine_schedule_with_warmup(opt, int(0.03 * total), total)
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        n_img = sum(ds.has_image)
        print(f"{len(ds)} samples ({n_img} with image, {len(ds) - n_img} text-only), {total} steps")

    step = 0
    for ep in range(a.epochs):
        sampler.set_epoch(ep)
        model.train()
        for batch in loader:
            batch = {k: (v.to(dev, non_blocking=True) if v is not None else None) for k, v in batch.items()}
            out = model(**batch)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 10 == 0:
                l = out.loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {ep} step {step}/{total} loss {l.item():.4f} lr {sched.get_last_lr()[0]:.2e}",
                          flush=True)
            if step % a.save_every == 0:
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "step": step},
                               os.path.join(a.out, f"step{step}.pt"))
                dist.barrier()

    if rank == 0:
        m = model.module
        m.llm.save_pretrained(os.path.join(a.out, "llm"))
        tok.save_pretrained(os.path.join(a.out, "llm"))
        torch.save(m.projector.state_dict(), os.path.join(a.out, "projector.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
