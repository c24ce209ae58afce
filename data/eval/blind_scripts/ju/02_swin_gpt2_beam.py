"""Swin image encoder + GPT-2 (cross-attention) decoder for chest X-ray reports.

Patient-level train/val split from the metadata table, DDP training, beam-search
decoding on every rank during validation, clinical efficacy with CheXbert on rank 0.

    torchrun --nproc_per_node=4 02_swin_gpt2_beam.py --meta data/cxr_meta.csv
"""
import argparse
import json
import os
import random

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from f1chexbert import F1CheXbert
from PIL import Image
from pycocoevalcap.bleu.bleu import Bleu
from sklearn.model_selection import GroupShuffleSplit
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T
from transformers import GPT2LMHeadModel, GPT2TokenizerFast, get_linear_schedule_with_warmup


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--meta", required=True)
    ap.add_argument("--images", default="data/images")
    ap.add_argument("--out", default="checkpoints/convnext_gpt2")
    ap.add_argument("--resume", default="")
    ap.add_argument("--val-frac", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--bs", type=int, default=12)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--beams", type=int, default=4)
    return ap.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def patient_split(meta, val_frac, seed):
    splitter = GroupShuffleSplit(n_splits=1, test_size=val_frac, random_state=seed)
    tr_idx, va_idx = next(splitter.split(meta, groups=meta["subject_id"]))
    return meta.iloc[tr_idx].reset_index(drop=True), meta.iloc[va_idx].reset_index(drop=True)


class ReportDS(Dataset):
    def __init__(self, meta, root, tok, max_tokens, train):
        self.meta, self.root, self.tok, self.max_tokens = meta, root, tok, max_tokens
        aug = [T.RandomAffine(degrees=7, translate=(0.05, 0.05), scale=(0.95, 1.05))] if train else []
        self.tf = T.Compose([T.Resize((384, 384))] + aug +
                            [T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.meta)

    def __getitem__(self, i):
        r = self.meta.iloc[i]
        img = self.tf(Image.open(os.path.join(self.root, r.path)).convert("RGB"))
        ids = [self.tok.bos_token_id] + self.tok.encode(r.report)[: self.max_tokens - 2] + [self.tok.eos_token_id]
        n = len(ids)
        ids = ids + [self.tok.eos_token_id] * (self.max_tokens - n)
        mask = [1] * n + [0] * (self.max_tokens - n)
        return img, torch.tensor(ids), torch.tensor(mask), i


class CXRGPT2(nn.Module):
    def __init__(self):
        super().__init__()
        self.visual = timm.create_model("swin_base_patch4_window12_384.ms_in22k", pretrained=True,
                                        num_classes=0)
        self.gpt = GPT2LMHeadModel.from_pretrained("gpt2", add_cross_attention=True)
        self.bridge = nn.Sequential(nn.Linear(self.visual.num_features, self.gpt.config.n_embd),
                                    nn.LayerNorm(self.gpt.config.n_embd))

    def visual_tokens(self, img):
        f = self.visual.forward_features(img)   # B, H, W, C
        return self.bridge(f.flatten(1, 2))      # B, HW, D

    def forward(self, img, ids, mask):
        mem = self.visual_tokens(img)
        return self.gpt(input_ids=ids, attention_mask=mask, encoder_hidden_states=mem,
                        use_cache=False).logits

    @torch.no_grad()
    def generate(self, img, bos, eos, beams=4, max_len=120, alpha=0.7):
        mem = self.visual_tokens(img)
        B, dev = img.size(0), img.device
        mem = mem.repeat_interleave(beams, 0)
        seq = torch.full((B * beams, 1), bos, device=dev, dtype=torch.long)
        logp_sum = torch.zeros(B, beams, device=dev)
        logp_sum[:, 1:] = float("-inf")
        logp_sum = logp_sum.view(-1)
        fin = torch.zeros(B * beams, dtype=torch.bool, device=dev)
        length = torch.ones(B * beams, device=dev)
        offs = torch.arange(B, device=dev).unsqueeze(1) * beams
        for _ in range(max_len - 1):
            lp = F.log_softmax(self.gpt(input_ids=seq, encoder_hidden_states=mem,
                                        use_cache=False).logits[:, -1].float(), -1)
            lp[fin] = float("-inf")
            lp[fin, eos] = 0.0
            V = lp.size(-1)
            cand = (logp_sum.unsqueeze(1) + lp).view(B, beams * V)
            val, idx = cand.topk(beams, -1)
            src = (offs + idx // V).view(-1)
            tok = (idx % V).view(-1)
            seq = torch.cat([seq[src], tok.unsqueeze(1)], 1)
            length = length[src] + (~fin[src]).float()
            fin = fin[src] | (tok == eos)
            logp_sum = val.view(-1)
            if fin.all():
                break
        score = (logp_sum / length.pow(alpha)).view(B, beams)
        return seq.view(B, beams, -1)[torch.arange(B, device=dev), score.argmax(1)]


def run_validation(model, loader, tok, args, device, rank, world, scorer):
    net = model.module
    net.eval()
    local = []
    for img, ids, mask, idx in loader:
        img = img.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = net.generate(img, tok.bos_token_id, tok.eos_token_id, args.beams, args.max_tokens)
        texts = tok.batch_decode(out[:, 1:], skip_special_tokens=True)
        local.extend(zip(idx.tolist(), texts))
    net.train()

    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    if rank != 0:
        return None
    preds = {}
    for part in gathered:
        for i, text in part:
            preds[i] = text.strip()       # DistributedSampler pads by repeating samples
    keys = sorted(preds)
    refs = [loader.dataset.meta.report[i] for i in keys]
    hyps = [preds[i] for i in keys]
    _, _, rep14, rep5 = scorer(hyps=hyps, refs=refs)
    bleu, _ = Bleu(4).compute_score({k: [r] for k, r in zip(keys, refs)},
                                    {k: [h] for k, h in zip(keys, hyps)}, verbose=0)
    return {"n": len(keys), "bleu4": bleu[3], "ce_f1_14": rep14["micro avg"]["f1-score"],
            "ce_f1_5": rep5["micro avg"]["f1-score"], "sample": hyps[0]}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    meta = pd.read_csv(args.meta)
    train_meta, val_meta = patient_split(meta, args.val_frac, args.seed)
    seed_everything(args.seed + rank)

    tok = GPT2TokenizerFast.from_pretrained("gpt2")
    train_ds = ReportDS(train_meta, args.images, tok, args.max_tokens, True)
    val_ds = ReportDS(val_meta, args.images, tok, args.max_tokens, False)
    tr_sampler = DistributedSampler(train_ds, seed=args.seed)
    va_sampler = DistributedSampler(val_ds, shuffle=False)
    tr_loader = DataLoader(train_ds, args.bs, sampler=tr_sampler, num_workers=6, pin_memory=True, drop_last=True)
    va_loader = DataLoader(val_ds, args.bs, sampler=va_sampler, num_workers=6, pin_memory=True)

    model = CXRGPT2()
    model.gpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    start_epoch, best = 0, 0.0
    ckpt = None
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
    model = DDP(model.to(device), device_ids=[local_rank], output_device=local_rank)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = get_linear_schedule_with_warmup(opt, 500, args.epochs * len(tr_loader))
    if ckpt is not None:
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        del ckpt
    scorer = F1CheXbert(device=device) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train {len(train_ds)} val {len(val_ds)} patients "
              f"{train_meta.subject_id.nunique()}/{val_meta.subject_id.nunique()} world {world}")

    for epoch in range(start_epoch, args.epochs):
        tr_sampler.set_epoch(epoch)
        running = torch.zeros(2, device=device)
        for it, (img, ids, mask, _) in enumerate(tr_loader):
            img, ids, mask = img.to(device, non_blocking=True), ids.to(device), mask.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(img, ids[:, :-1], mask[:, :-1])
            labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
            if it % 100 == 0:
                stats = running.clone()
                dist.all_reduce(stats)
                if rank == 0:
                    print(f"epoch {epoch} it {it}/{len(tr_loader)} loss {stats[0] / stats[1]:.4f}")

        res = run_validation(model, va_loader, tok, args, device, rank, world, scorer)
        if rank == 0:
            print(json.dumps({"epoch": epoch, **res}))
            state = {"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                     "scheduler": sched.state_dict(), "epoch": epoch,
                     "best": max(best, res["ce_f1_14"])}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if res["ce_f1_14"] > best:
                best = res["ce_f1_14"]
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
