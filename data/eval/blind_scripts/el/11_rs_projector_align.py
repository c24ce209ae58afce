"""Projector alignment on remote-sensing captions (RSICD + UCM + our aerial set).

The generic LLaVA stage-1 projector does poorly on aerial imagery, so we re-align
it on ~120k domain captions for a few epochs before the stage-2 tuning.
Vision tower and LLM are frozen.

    torchrun --nproc_per_node 4 11_rs_projector_align.py --train rs_captions_train.jsonl \
        --val rs_captions_val.jsonl --image_dir /data/rs --init_projector llava-v1.5-7b/mm_projector.bin
"""
import argparse
import functools
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
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoModelForCausalLM, AutoTokenizer, CLIPImageProcessor, CLIPVisionModel

IGNORE_INDEX = -100
PROMPTS = ["Describe this aerial image.", "What is shown in this satellite image?",
           "Write a short caption for the remote sensing image."]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llm", default="lmsys/vicuna-7b-v1.5")
    ap.add_argument("--vision_tower", default="openai/clip-vit-large-patch14-336")
    ap.add_argument("--init_projector", default=None)
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--image_dir", required=True)
    ap.add_argument("--output_dir", default="runs/rs-align")
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--warmup_steps", type=int, default=200)
    ap.add_argument("--max_len", type=int, default=128)
    return ap.parse_args()


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


class RSCaptions(Dataset):
    def __init__(self, rows, image_dir, tok, proc, max_len):
        self.rows, self.image_dir, self.tok, self.proc, self.max_len = rows, image_dir, tok, proc, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        prompt = self.tok(f"USER: {PROMPTS[i % len(PROMPTS)]} ASSISTANT:", add_special_tokens=False).input_ids
        cap = self.tok(" " + r["caption"].strip(), add_special_tokens=False).input_ids + [self.tok.eos_token_id]
        ids = ([self.tok.bos_token_id] + prompt + cap)[: self.max_len]
        labels = ([IGNORE_INDEX] * (1 + len(prompt)) + cap)[: self.max_len]
        img = Image.open(os.path.join(self.image_dir, r["image"])).convert("RGB")
        return torch.tensor(ids), torch.tensor(labels), self.proc(img, return_tensors="pt").pixel_values[0]


def pad_collate(batch, pad_id=0):
    ids, labels, px = zip(*batch)
    lengths = torch.tensor([len(x) for x in ids])
    ids = nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=pad_id)
    labels = nn.utils.rnn.pad_sequence(labels, batch_first=True, padding_value=IGNORE_INDEX)
    mask = (torch.arange(ids.size(1))[None] < lengths[:, None]).long()
    return ids, mask, labels, torch.stack(px)


class AlignModel(nn.Module):
    def __init__(self, llm, vision):
        super().__init__()
        self.llm, self.vision = llm, vision
        d = llm.config.hidden_size
        self.mm_projector = nn.Sequential(nn.Linear(vision.config.hidden_size, d), nn.GELU(), nn.Linear(d, d))

    def forward(self, ids, mask, labels, px):
        with torch.no_grad():
            feats = self.vision(px, output_hidden_states=True).hidden_states[-2][:, 1:]
        img = self.mm_projector(feats.float()).to(torch.bfloat16)
        txt = self.llm.get_input_embeddings()(ids)
        x = torch.cat([txt[:, :1], img, txt[:, 1:]], 1)
        m = torch.cat([mask[:, :1], mask.new_ones(img.shape[:2]), mask[:, 1:]], 1)
        y = torch.cat([labels[:, :1], labels.new_full(img.shape[:2], IGNORE_INDEX), labels[:, 1:]], 1)
        return self.llm(inputs_embeds=x, attention_mask=m, labels=y).loss


class AlignTrainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        self.writer = SummaryWriter(os.path.join(args.output_dir, "tb")) if self.rank == 0 else None

        self.tok = AutoTokenizer.from_pretrained(args.llm, use_fast=False)
        self.tok.pad_token = self.tok.unk_token
        proc = CLIPImageProcessor.from_pretrained(args.vision_tower)
        llm = AutoModelForCausalLM.from_pretrained(args.llm, torch_dtype=torch.bfloat16).requires_grad_(False)
        vision = CLIPVisionModel.from_pretrained(args.vision_tower, torch_dtype=torch.bfloat16).requires_grad_(False)
        model = AlignModel(llm, vision)
        if args.init_projector:
            sd = torch.load(args.init_projector, map_location="cpu")
            model.mm_projector.load_state_dict({k.split("mm_projector.")[-1]: v.float() for k, v in sd.items()})
        self.model = DDP(model.to(self.device), device_ids=[self.local_rank])

        pad = functools.partial(pad_collate, pad_id=self.tok.pad_token_id)
        self.train_ds = RSCaptions(read_jsonl(args.train), args.image_dir, self.tok, proc, args.max_len)
        self.val_ds = RSCaptions(read_jsonl(args.val), args.image_dir, self.tok, proc, args.max_len)
        self.train_sampler = DistributedSampler(self.train_ds, shuffle=True, drop_last=True)
        self.train_loader = DataLoader(self.train_ds, batch_size=args.batch_size, sampler=self.train_sampler,
                                       num_workers=8, pin_memory=True, collate_fn=pad)
        self.val_loader = DataLoader(self.val_ds, batch_size=args.batch_size, num_workers=4, collate_fn=pad,
                                     sampler=DistributedSampler(self.val_ds, shuffle=False))

        self.opt = torch.optim.AdamW(self.model.module.mm_projector.parameters(), lr=args.lr, weight_decay=0.0)
        self.total = args.epochs * len(self.train_loader)
        w = args.warmup_steps
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: min(1.0, (s + 1) / w) * 0.5 * (1 + math.cos(math.pi * min(s, self.total) / self.total)))
        self.step = 0

    def to_dev(self, batch):
        ids, mask, labels, px = batch
        return (ids.to(self.device, non_blocking=True), mask.to(self.device, non_blocking=True),
                labels.to(self.device, non_blocking=True), px.to(self.device, torch.bfloat16, non_blocking=True))

    @torch.no_grad()
    def validate(self):
        self.model.eval()
        s = torch.zeros(2, device=self.device)
        for batch in self.val_loader:
            s[0] += self.model.module(*self.to_dev(batch)).float()
            s[1] += 1
        dist.all_reduce(s)
        self.model.train()
        return (s[0] / s[1]).item()

    def train_epoch(self, epoch):
        self.model.train()
        t0 = time.time()
        for batch in self.train_loader:
            loss = self.model(*self.to_dev(batch))
            loss.backward()
            nn.utils.clip_grad_norm_(self.model.module.mm_projector.parameters(), 1.0)
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)
            self.step += 1
            if self.step % 25 == 0 and self.rank == 0:
                self.writer.add_scalar("train/loss", loss.item(), self.step)
                self.writer.add_scalar("train/lr", self.sched.get_last_lr()[0], self.step)
                print(f"epoch {epoch} step {self.step}/{self.total} loss {loss.item():.4f} "
                      f"{(time.time() - t0) / 25:.2f}s/it", flush=True)
                t0 = time.time()

    def save(self, name):
        if self.rank == 0:
            os.makedirs(self.args.output_dir, exist_ok=True)
            torch.save(self.model.module.mm_projector.state_dict(), os.path.join(self.args.output_dir, name))
        dist.barrier()

    def fit(self):
        best = float("inf")
        for epoch in range(self.args.epochs):
            self.train_epoch(epoch)
            val = self.validate()
            if self.rank == 0:
                self.writer.add_scalar("val/loss", val, self.step)
                print(f"epoch {epoch} val_loss {val:.4f}", flush=True)
            self.save(f"mm_projector_epoch{epoch}.bin")
            if val < best:
                best = val
                self.save("mm_projector_best.bin")
        if self.writer:
            self.writer.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    AlignTrainer(get_args()).fit()
