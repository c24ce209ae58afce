"""Frozen RAD-DINO encoder + trainable transformer decoder (findings + impression).

The MIMIC-CXR official split is not used here; studies are re-split by patient
so that the validation and test sets have no subject overlap with training.

Usage:
    torchrun --nproc_per_node=8 03_raddino_frozen_decoder.py --config configs/raddino_dec.yaml
"""
import argparse
import dataclasses
import os
import random
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoImageProcessor, AutoModel, AutoTokenizer


@dataclass
class Config:
    studies_csv: str = "data/mimic/studies.csv"
    image_dir: str = "data/mimic/jpg"
    encoder: str = "microsoft/rad-dino"
    tokenizer: str = "microsoft/BiomedVLP-CXR-BERT-specialized"
    out_dir: str = "outputs/raddino_dec"
    val_frac: float = 0.05
    test_frac: float = 0.1
    seed: int = 42
    d_model: int = 768
    n_layers: int = 6
    max_len: int = 160
    batch_size: int = 32
    epochs: int = 15
    lr: float = 3e-4
    weight_decay: float = 0.05
    num_workers: int = 8


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ns = ap.parse_args()
    cfg = Config()
    if ns.config:
        with open(ns.config) as f:
            cfg = dataclasses.replace(cfg, **(yaml.safe_load(f) or {}))
    return cfg


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def split_by_patient(df, val_frac, test_frac):
    patients = df.subject_id.unique()
    np.random.shuffle(patients)
    n_val, n_test = int(len(patients) * val_frac), int(len(patients) * test_frac)
    val_p = set(patients[:n_val])
    test_p = set(patients[n_val:n_val + n_test])
    split = np.where(df.subject_id.isin(val_p), "val",
                     np.where(df.subject_id.isin(test_p), "test", "train"))
    return df.assign(split=split)


class StudyDataset(Dataset):
    def __init__(self, df, image_dir, processor, tokenizer, max_len):
        self.df = df.reset_index(drop=True)
        self.image_dir = image_dir
        self.processor = processor
        self.tokenizer = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.df)

    def __getitem__(self, idx):
        row = self.df.iloc[idx]
        image = Image.open(os.path.join(self.image_dir, row.dicom_path)).convert("RGB")
        pixel_values = self.processor(images=image, return_tensors="pt").pixel_values[0]
        text = f"FINDINGS: {row.findings} IMPRESSION: {row.impression}"
        tok = self.tokenizer(text, max_length=self.max_len, truncation=True,
                             padding="max_length", return_tensors="pt")
        return pixel_values, tok.input_ids[0], tok.attention_mask[0]


class RadDinoReportModel(nn.Module):
    def __init__(self, cfg, vocab_size, pad_id):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(cfg.encoder)
        self.encoder.requires_grad_(False)
        self.encoder.eval()
        enc_dim = self.encoder.config.hidden_size
        self.adapter = nn.Sequential(nn.Linear(enc_dim, cfg.d_model), nn.GELU(),
                                     nn.Linear(cfg.d_model, cfg.d_model))
        self.embed = nn.Embedding(vocab_size, cfg.d_model, padding_idx=pad_id)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        block = nn.TransformerDecoderLayer(cfg.d_model, 12, 4 * cfg.d_model, 0.1,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.decoder = nn.TransformerDecoder(block, cfg.n_layers, norm=nn.LayerNorm(cfg.d_model))
        self.head = nn.Linear(cfg.d_model, vocab_size)

    def train(self, mode=True):
        super().train(mode)
        self.encoder.eval()
        return self

    def forward(self, pixel_values, input_ids, attention_mask):
        with torch.no_grad():
            patches = self.encoder(pixel_values=pixel_values).last_hidden_state
        memory = self.adapter(patches)
        L = input_ids.size(1)
        pos = torch.arange(L, device=input_ids.device)
        x = self.embed(input_ids) + self.pos(pos)[None]
        causal = nn.Transformer.generate_square_subsequent_mask(L, device=input_ids.device)
        h = self.decoder(x, memory, tgt_mask=causal, tgt_key_padding_mask=attention_mask == 0,
                         tgt_is_causal=True)
        return self.head(h)


def lm_loss(logits, input_ids, attention_mask, reduction="mean"):
    target = input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, -100)
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)),
                           target.reshape(-1), ignore_index=-100, reduction=reduction)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    totals = torch.zeros(2, device=device)
    for pixel_values, ids, mask in loader:
        pixel_values, ids, mask = pixel_values.to(device), ids.to(device), mask.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(pixel_values, ids, mask)
        totals[0] += lm_loss(logits, ids, mask, reduction="sum")
        totals[1] += mask[:, 1:].sum()
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[1]).item()


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    set_seed(cfg.seed + rank)

    studies = pd.read_csv(cfg.studies_csv).dropna(subset=["findings", "impression"])
    studies = split_by_patient(studies, cfg.val_frac, cfg.test_frac)
    processor = AutoImageProcessor.from_pretrained(cfg.encoder)
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer, trust_remote_code=True)

    def make_dataset(split):
        return StudyDataset(studies[studies.split == split], cfg.image_dir, processor,
                            tokenizer, cfg.max_len)

    train_ds = make_dataset("train")
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=train_sampler,
                              drop_last=True, num_workers=cfg.num_workers, pin_memory=True)
    # strided shard without padding so summed val loss counts every study exactly once
    val_ds = make_dataset("val")
    val_shard = Subset(val_ds, range(rank, len(val_ds), world_size))
    val_loader = DataLoader(val_shard, batch_size=cfg.batch_size, shuffle=False,
                            num_workers=cfg.num_workers, pin_memory=True)

    model = RadDinoReportModel(cfg, len(tokenizer), tokenizer.pad_token_id).to(device)
    model = DDP(model, device_ids=[local_rank])
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps = cfg.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=cfg.lr, total_steps=steps,
                                                    pct_start=0.05)

    writer = None
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(cfg.out_dir, "tb"))
        studies[["study_id", "subject_id", "split"]].to_csv(
            os.path.join(cfg.out_dir, "split.csv"), index=False)
        print(f"[rank0] {world_size} ranks, {len(train_ds)} train studies, "
              f"{len(val_ds)} val studies")

    best_val = float("inf")
    global_step = 0
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        for pixel_values, ids, mask in train_loader:
            pixel_values = pixel_values.to(device, non_blocking=True)
            ids, mask = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(pixel_values, ids, mask)
            loss = lm_loss(logits, ids, mask)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            scheduler.step()
            global_step += 1
            if writer is not None and global_step % 25 == 0:
                writer.add_scalar("train/loss", loss.item(), global_step)
                writer.add_scalar("train/lr", scheduler.get_last_lr()[0], global_step)

        val_loss = validate(model, val_loader, device)
        if rank == 0:
            writer.add_scalar("val/loss", val_loss, global_step)
            print(f"epoch {epoch}: val loss {val_loss:.4f} ppl {np.exp(val_loss):.2f}")
            trainable_state = {k: v for k, v in model.module.state_dict().items()
                               if not k.startswith("encoder.")}
            torch.save({"model": trainable_state, "epoch": epoch, "cfg": dataclasses.asdict(cfg)},
                       os.path.join(cfg.out_dir, "last.pt"))
            if val_loss < best_val:
                best_val = val_loss
                torch.save({"model": trainable_state, "epoch": epoch},
                           os.path.join(cfg.out_dir, "best.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
