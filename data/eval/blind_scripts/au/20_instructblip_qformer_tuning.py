"""InstructBLIP (Vicuna-7B) instruction tuning: only the instruction-aware Q-Former, the query
tokens and the language projection are trained; the ViT-g and Vicuna stay frozen in fp16.

Training mix: A-OKVQA rationales + OCR-VQA + TextCaps, sampled proportionally to sqrt(size).

    torchrun --nproc_per_node=8 20_instructblip_qformer_tuning.py --mix-config configs/instruct_mix.json \
        --out ckpt/instructblip_vicuna7b_mix
"""
import argparse
import json
import math
import os
import random

import torch
import torch.distributed as dist
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset, WeightedRandomSampler
from torch.utils.data.distributed import DistributedSampler
from transformers import InstructBlipForConditionalGeneration, InstructBlipProcessor


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--mix-config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="Salesforce/instructblip-vicuna-7b")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--iters-per-epoch", type=int, default=5000)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--max-txt-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--local_rank", type=int, default=0)
    return p.parse_args()


class InstructionSet(Dataset):
    """Each line: {"image": path, "instruction": str, "answer": str}."""

    def __init__(self, jsonl, image_root):
        with open(jsonl) as f:
            self.rows = [json.loads(l) for l in f]
        self.image_root = image_root

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return Image.open(os.path.join(self.image_root, r["image"])).convert("RGB"), r["instruction"], r["answer"]


class Collator:
    def __init__(self, processor, max_len):
        self.processor, self.max_len = processor, max_len

    def __call__(self, batch):
        images, instr, answers = zip(*batch)
        enc = self.processor(images=list(images), text=list(instr), return_tensors="pt", padding="longest",
                             truncation=True, max_length=self.max_len)
        tok = self.processor.tokenizer
        ans = tok([a + tok.eos_token for a in answers], return_tensors="pt", padding="longest",
                  truncation=True, max_length=self.max_len, add_special_tokens=False)
        enc["input_ids"] = torch.cat([enc["input_ids"], ans.input_ids], 1)
        enc["attention_mask"] = torch.cat([enc["attention_mask"], ans.attention_mask], 1)
        labels = torch.full_like(enc["input_ids"], -100)
        labels[:, -ans.input_ids.size(1):] = ans.input_ids.masked_fill(ans.attention_mask == 0, -100)
        enc["labels"] = labels
        return enc


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    processor = InstructBlipProcessor.from_pretrained(args.model)
    model = InstructBlipForConditionalGeneration.from_pretrained(args.model, torch_dtype=torch.float16)
    model.vision_model.requires_grad_(False)
    model.language_model.requires_grad_(False)
    # trainable parts in fp32 for a stable optimizer
    for m in (model.qformer, model.language_projection):
        m.float()
    model.query_tokens.data = model.query_tokens.data.float()
    model.to(device)
    ddp = DDP(model, device_ids=[args.local_rank])

    mix = json.load(open(args.mix_config))
    sets = [InstructionSet(d["jsonl"], d["image_root"]) for d in mix["datasets"]]
    full = ConcatDataset(sets)
    # sqrt-size mixing weights, then each rank draws its own iters_per_epoch * batch samples
    w_per_set = [math.sqrt(len(s)) / len(s) for s in sets]
    weights = torch.tensor([w for s, w in zip(sets, w_per_set) for _ in range(len(s))], dtype=torch.double)
    g = torch.Generator().manual_seed(args.seed + rank)
    sampler = WeightedRandomSampler(weights, num_samples=args.iters_per_epoch * args.batch_size,
                                    replacement=True, generator=g)
    loader = DataLoader(full, batch_size=args.batch_size, sampler=sampler, num_workers=6, drop_last=True,
                        collate_fn=Collator(processor, args.max_txt_len), pin_memory=True)

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.05, betas=(0.9, 0.999))
    total = args.epochs * args.iters_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / args.warmup if s < args.warmup
        else 0.5 * (1 + math.cos(math.pi * (s - args.warmup) / (total - args.warmup))))
    scaler = torch.cuda.amp.GradScaler()

    step = 0
    for epoch in range(args.epochs):
        ddp.train()
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16):
                loss = ddp(**batch).loss
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            if step % 50 == 0:
                l = loss.detach().float()
                dist.all_reduce(l)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{total} loss {l.item() / world:.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e}", flush=True)

        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            sd = {k: v.cpu() for k, v in model.state_dict().items()
                  if k.startswith(("qformer.", "query_tokens", "language_projection."))}
            torch.save({"model": sd, "epoch": epoch, "optimizer": opt.state_dict()},
                       os.path.join(args.out, f"checkpoint_{epoch}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
