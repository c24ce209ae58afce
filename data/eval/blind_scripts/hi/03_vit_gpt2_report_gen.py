"""
Radiology report generation: ViT-B/16 image encoder + GPT-2 decoder with cross-attention.
Trained on MIMIC-CXR findings sections (one frontal image per study).

torchrun --standalone --nproc_per_node=8 03_vit_gpt2_report_gen.py --config configs/vit_gpt2_mimic.yaml
"""
import argparse
import math
import os
import time

import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast, get_cosine_schedule_with_warmup

DEFAULTS = {
    "image_root": "/mnt/mimic-cxr-jpg/2.0.0/files",
    "train_csv": "data/mimic_findings_train.csv",
    "val_csv": "data/mimic_findings_validate.csv",
    "vit": "vit_base_patch16_224.augreg_in21k_ft_in1k",
    "gpt2": "gpt2",
    "max_len": 128,
    "batch_size": 16,
    "epochs": 10,
    "lr": 5e-5,
    "encoder_lr": 1e-5,
    "warmup_ratio": 0.05,
    "num_workers": 8,
    "output_dir": "outputs/vit_gpt2",
    "save_every": 1,
}


class MimicFindings(Dataset):
    def __init__(self, csv_path, image_root, tokenizer, max_len, train):
        self.df = pd.read_csv(csv_path)
        self.image_root = image_root
        self.tok = tokenizer
        self.max_len = max_len
        norm = transforms.Normalize([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])
        if train:
            self.tf = transforms.Compose([
                transforms.Resize(256),
                transforms.RandomCrop(224),
                transforms.ColorJitter(0.1, 0.1),
                transforms.ToTensor(), norm])
        else:
            self.tf = transforms.Compose([
                transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm])

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        row = self.df.iloc[i]
        img = Image.open(os.path.join(self.image_root, row["dicom_path"])).convert("RGB")
        text = " ".join(str(row["findings"]).split()) + self.tok.eos_token
        enc = self.tok(text, max_length=self.max_len, truncation=True, padding="max_length",
                       return_tensors="pt")
        ids = enc.input_ids[0]
        mask = enc.attention_mask[0]
        labels = ids.clone()
        labels[mask == 0] = -100
        return self.tf(img), ids, mask, labels


class ViTGPT2(nn.Module):
    def __init__(self, vit_name, gpt2_name):
        super().__init__()
        self.encoder = timm.create_model(vit_name, pretrained=True, num_classes=0)
        cfg = GPT2Config.from_pretrained(gpt2_name, add_cross_attention=True)
        self.decoder = GPT2LMHeadModel.from_pretrained(gpt2_name, config=cfg)
        self.proj = nn.Sequential(nn.Linear(self.encoder.num_features, cfg.n_embd), nn.LayerNorm(cfg.n_embd))

    def encode(self, images):
        return self.proj(self.encoder.forward_features(images))

    def forward(self, images, input_ids, attention_mask, labels):
        memory = self.encode(images)
        out = self.decoder(input_ids=input_ids, attention_mask=attention_mask,
                           encoder_hidden_states=memory, labels=labels)
        return out.loss


def load_config():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=None)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    cfg["resume"] = args.resume
    return cfg


@torch.no_grad()
def validation_loss(model, loader, device):
    model.eval()
    stats = torch.zeros(2, device=device)
    for images, ids, mask, labels in loader:
        images, ids, mask, labels = (t.to(device, non_blocking=True) for t in (images, ids, mask, labels))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(images, ids, mask, labels)
        n = images.size(0)
        stats[0] += loss.float() * n
        stats[1] += n
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    return (stats[0] / stats[1]).item()


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(1234)

    tokenizer = GPT2TokenizerFast.from_pretrained(cfg["gpt2"])
    tokenizer.pad_token = tokenizer.eos_token

    train_ds = MimicFindings(cfg["train_csv"], cfg["image_root"], tokenizer, cfg["max_len"], train=True)
    val_ds = MimicFindings(cfg["val_csv"], cfg["image_root"], tokenizer, cfg["max_len"], train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=train_sampler,
                          num_workers=cfg["num_workers"], pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=cfg["batch_size"], sampler=val_sampler,
                        num_workers=cfg["num_workers"], pin_memory=True)

    model = ViTGPT2(cfg["vit"], cfg["gpt2"]).to(device)
    model = DDP(model, device_ids=[local_rank])

    enc_params = list(model.module.encoder.parameters())
    enc_ids = {id(p) for p in enc_params}
    other = [p for p in model.parameters() if id(p) not in enc_ids]
    optimizer = torch.optim.AdamW([
        {"params": enc_params, "lr": cfg["encoder_lr"]},
        {"params": other, "lr": cfg["lr"]},
    ], weight_decay=0.01)
    total_steps = cfg["epochs"] * len(train_dl)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(cfg["warmup_ratio"] * total_steps), total_steps)

    start_epoch = 0
    if cfg["resume"]:
        ckpt = torch.load(cfg["resume"], map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1

    if rank == 0:
        os.makedirs(cfg["output_dir"], exist_ok=True)
        print(f"train {len(train_ds)} studies, val {len(val_ds)}, {len(train_dl)} steps/epoch")

    best_val = math.inf
    for epoch in range(start_epoch, cfg["epochs"]):
        model.train()
        t0 = time.time()
        for step, (images, ids, mask, labels) in enumerate(train_dl):
            images = images.to(device, non_blocking=True)
            ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(images, ids, mask, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and step % 200 == 0:
                print(f"[ep {epoch} {step}/{len(train_dl)}] loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[1]:.2e} {time.time() - t0:.0f}s", flush=True)

        val_loss = validation_loss(model, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} val loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}", flush=True)
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": epoch, "val_loss": val_loss}
            if (epoch + 1) % cfg["save_every"] == 0:
                torch.save(ckpt, os.path.join(cfg["output_dir"], f"epoch{epoch:02d}.pt"))
            if val_loss < best_val:
                best_val = val_loss
                torch.save(ckpt, os.path.join(cfg["output_dir"], "best.pt"))
                tokenizer.save_pretrained(cfg["output_dir"])
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
