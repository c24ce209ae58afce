"""DeiT-III + GPT-2-medium (cross-attention) report generator trained on a mix of
MIMIC-CXR (with CheXpert labels) and an external report corpus without labels.

The auxiliary multi-label head only receives a loss on the labelled studies of a batch.
GPT-2-medium is trained with activation checkpointing to fit 512-token reports.

    torchrun --nproc_per_node=8 19_deit3_gpt2_aux.py --mix data/mix_train.jsonl --val data/mimic_val.jsonl
"""
import argparse
import json
import os

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from transformers import GPT2LMHeadModel, GPT2TokenizerFast, get_cosine_schedule_with_warmup

N_OBS = 14


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mix", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--image-root", default="/data/cxr")
    ap.add_argument("--out", default="runs/deit3_gpt2m")
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--aux-weight", type=float, default=0.3)
    ap.add_argument("--max-len", type=int, default=512)
    return ap.parse_args()


class MixedReports(Dataset):
    """jsonl rows: {"image": ..., "report": ..., "labels": [14 x {1,0,-1}] or null}"""

    def __init__(self, path, root, tok, max_len, train):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.root, self.tok, self.max_len = root, tok, max_len
        self.tf = transforms.Compose([
            transforms.Resize((224, 224)),
            *([transforms.RandomAffine(5, translate=(0.04, 0.04))] if train else []),
            transforms.ToTensor(), transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        img = self.tf(Image.open(os.path.join(self.root, r["image"])).convert("RGB"))
        ids = [self.tok.bos_token_id] + self.tok.encode(r["report"])[: self.max_len - 2] + [self.tok.eos_token_id]
        mask = [1] * len(ids) + [0] * (self.max_len - len(ids))
        ids += [self.tok.eos_token_id] * (self.max_len - len(ids))
        has = r.get("labels") is not None
        lab = torch.tensor([max(v, 0) for v in r["labels"]], dtype=torch.float) if has else torch.zeros(N_OBS)
        return img, torch.tensor(ids), torch.tensor(mask), lab, torch.tensor(has)


class DeiTGPT2(nn.Module):
    def __init__(self):
        super().__init__()
        self.vit = timm.create_model("deit3_base_patch16_224.fb_in22k_ft_in1k", pretrained=True, num_classes=0)
        self.gpt = GPT2LMHeadModel.from_pretrained("gpt2-medium", add_cross_attention=True)
        d = self.gpt.config.n_embd
        self.vis = nn.Linear(self.vit.num_features, d)
        self.aux = nn.Sequential(nn.LayerNorm(self.vit.num_features), nn.Linear(self.vit.num_features, N_OBS))

    def forward(self, img, ids, mask):
        tokens = self.vit.forward_features(img)
        logits = self.gpt(input_ids=ids, attention_mask=mask, encoder_hidden_states=self.vis(tokens),
                          use_cache=False).logits
        return logits, self.aux(tokens[:, 0])


def lm_loss(logits, ids, mask, reduction="mean"):
    tgt = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), tgt.flatten(), ignore_index=-100,
                           reduction=reduction)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = GPT2TokenizerFast.from_pretrained("gpt2-medium")
    train_ds = MixedReports(args.mix, args.image_root, tok, args.max_len, True)
    val_ds = MixedReports(args.val, args.image_root, tok, args.max_len, False)
    val_ds.rows = val_ds.rows[rank::world]
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.bs, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, args.bs, shuffle=False, num_workers=8, pin_memory=True)

    model = DeiTGPT2()
    model.gpt.gradient_checkpointing_enable()
    model = DDP(model.to(device), device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = get_cosine_schedule_with_warmup(opt, 500, args.epochs * len(train_dl))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        n_lab = sum(r.get("labels") is not None for r in train_ds.rows)
        print(f"{len(train_ds)} training studies ({n_lab} with CheXpert labels)", flush=True)

    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, (img, ids, mask, lab, has) in enumerate(train_dl):
            img, ids, mask = img.to(device, non_blocking=True), ids.to(device), mask.to(device)
            lab, has = lab.to(device), has.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, obs = model(img, ids, mask)
            loss = lm_loss(logits, ids, mask)
            if has.any():
                loss = loss + args.aux_weight * F.binary_cross_entropy_with_logits(obs[has].float(), lab[has])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and step % 50 == 0:
                print(f"epoch {epoch} step {step}/{len(train_dl)} loss {loss.item():.4f}", flush=True)

        model.eval()
        acc = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for img, ids, mask, _, _ in val_dl:
                img, ids, mask = img.to(device), ids.to(device), mask.to(device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits, _ = model.module(img, ids, mask)
                acc[0] += lm_loss(logits, ids, mask, reduction="sum").double()
                acc[1] += (mask[:, 1:] == 1).sum()
        dist.all_reduce(acc)
        val_nll = (acc[0] / acc[1]).item()
        if rank == 0:
            print(f"epoch {epoch} val nll {val_nll:.4f}", flush=True)
            state = {"model": model.module.state_dict(), "epoch": epoch, "val_nll": val_nll}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if val_nll < best:
                best = val_nll
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
