"""High-resolution (512px) DenseNet-121 + Transformer report generator with an
auxiliary 14-way CheXpert observation head.

    torchrun --nproc_per_node=8 09_densenet_hires_trainer.py --img-size 512 --batch-per-gpu 4
"""
import argparse
import json
import logging
import os
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from transformers import AutoTokenizer

CHEXPERT = ["No Finding", "Enlarged Cardiomediastinum", "Cardiomegaly", "Lung Opacity", "Lung Lesion",
            "Edema", "Consolidation", "Pneumonia", "Atelectasis", "Pneumothorax", "Pleural Effusion",
            "Pleural Other", "Fracture", "Support Devices"]
log = logging.getLogger(__name__)


class CXRStudies(Dataset):
    """Rows: image path, report text, 14 CheXpert labels (1, 0, -1 uncertain, blank)."""

    def __init__(self, csv_path, image_root, tokenizer, img_size, max_len, train):
        self.df = pd.read_csv(csv_path)
        self.image_root = Path(image_root)
        self.tok, self.max_len = tokenizer, max_len
        ops = [transforms.Resize((img_size, img_size))]
        if train:
            ops += [transforms.RandomAffine(10, translate=(0.06, 0.06), scale=(0.9, 1.1)),
                    transforms.ColorJitter(brightness=0.1, contrast=0.1)]
        ops += [transforms.Grayscale(3), transforms.ToTensor(),
                transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]
        self.tf = transforms.Compose(ops)

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        img = self.tf(Image.open(self.image_root / r["path"]))
        enc = self.tok(r["report"], max_length=self.max_len, truncation=True, padding="max_length",
                       return_tensors="pt")
        lab = torch.tensor(r[CHEXPERT].fillna(0).replace(-1, 1).values.astype("float32"))
        return img, enc.input_ids[0], lab


class DenseReportNet(nn.Module):
    def __init__(self, vocab_size, pad_id, d_model=512, n_layers=3, max_len=150):
        super().__init__()
        backbone = torchvision.models.densenet121(weights="IMAGENET1K_V1")
        self.features = backbone.features                      # 1024 channels, stride 32
        self.obs_head = nn.Linear(1024, len(CHEXPERT))
        self.visual_proj = nn.Linear(1024, d_model)
        self.tok = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        self.pos = nn.Embedding(max_len, d_model)
        self.decoder = nn.TransformerDecoder(
            nn.TransformerDecoderLayer(d_model, 8, 2048, 0.1, batch_first=True), n_layers)
        self.lm = nn.Linear(d_model, vocab_size)
        self.pad_id = pad_id

    def forward(self, images, tokens):
        fmap = F.relu(self.features(images))                   # B, 1024, 16, 16
        obs_logits = self.obs_head(fmap.mean((2, 3)))
        mem = self.visual_proj(fmap.flatten(2).transpose(1, 2))
        L = tokens.size(1)
        x = self.tok(tokens) + self.pos(torch.arange(L, device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(L, device=tokens.device)
        h = self.decoder(x, mem, tgt_mask=mask, tgt_key_padding_mask=tokens == self.pad_id)
        return self.lm(h), obs_logits


class Trainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)

        self.tok = AutoTokenizer.from_pretrained("dmis-lab/biobert-base-cased-v1.2")
        self.train_ds = CXRStudies(args.train_csv, args.image_root, self.tok, args.img_size, args.max_len, True)
        self.val_ds = CXRStudies(args.val_csv, args.image_root, self.tok, args.img_size, args.max_len, False)
        self.train_sampler = DistributedSampler(self.train_ds, shuffle=True, drop_last=True)
        self.train_dl = DataLoader(self.train_ds, args.batch_per_gpu, sampler=self.train_sampler,
                                   num_workers=6, pin_memory=True, drop_last=True)
        self.val_dl = DataLoader(self.val_ds, args.batch_per_gpu * 2,
                                 sampler=DistributedSampler(self.val_ds, shuffle=False, drop_last=True),
                                 num_workers=6, pin_memory=True)

        net = DenseReportNet(self.tok.vocab_size, self.tok.pad_token_id, max_len=args.max_len)
        self.model = DDP(net.to(self.device), device_ids=[self.local_rank])
        self.opt = torch.optim.Adam(self.model.parameters(), lr=args.lr)
        self.sched = torch.optim.lr_scheduler.ReduceLROnPlateau(self.opt, mode="min", factor=0.5, patience=2)
        self.out = Path(args.out)
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)

    def losses(self, images, ids, labels):
        logits, obs = self.model(images, ids[:, :-1])
        lm = F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1),
                             ignore_index=self.tok.pad_token_id)
        cls = F.binary_cross_entropy_with_logits(obs, labels)
        return lm, cls

    def train_epoch(self, epoch):
        self.model.train()
        self.train_sampler.set_epoch(epoch)
        for it, (images, ids, labels) in enumerate(self.train_dl):
            images, ids, labels = (t.to(self.device, non_blocking=True) for t in (images, ids, labels))
            lm, cls = self.losses(images, ids, labels)
            loss = lm + self.args.cls_weight * cls
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), 5.0)
            self.opt.step()
            if self.rank == 0 and it % 200 == 0:
                log.info("epoch %d it %d lm %.4f cls %.4f", epoch, it, lm.item(), cls.item())

    @torch.no_grad()
    def validate(self):
        self.model.eval()
        acc = torch.zeros(3, device=self.device)
        for images, ids, labels in self.val_dl:
            images, ids, labels = (t.to(self.device, non_blocking=True) for t in (images, ids, labels))
            lm, cls = self.losses(images, ids, labels)
            acc += torch.stack([lm * images.size(0), cls * images.size(0),
                                torch.tensor(float(images.size(0)), device=self.device)])
        dist.all_reduce(acc)
        return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()

    def save(self, name, epoch, val):
        if self.rank == 0:
            torch.save({"model": self.model.module.state_dict(), "opt": self.opt.state_dict(),
                        "epoch": epoch, "val": val}, self.out / name)

    def fit(self):
        best = float("inf")
        for epoch in range(self.args.epochs):
            self.train_epoch(epoch)
            val_lm, val_cls = self.validate()
            self.sched.step(val_lm)
            if self.rank == 0:
                log.info("epoch %d val_lm %.4f val_cls %.4f", epoch, val_lm, val_cls)
                with open(self.out / "history.jsonl", "a") as f:
                    f.write(json.dumps({"epoch": epoch, "val_lm": val_lm, "val_cls": val_cls}) + "\n")
            self.save("last.pt", epoch, val_lm)
            if val_lm < best:
                best = val_lm
                self.save("best.pt", epoch, val_lm)
            dist.barrier()
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-csv", default="data/mimic_chexpert/train.csv")
    ap.add_argument("--val-csv", default="data/mimic_chexpert/val.csv")
    ap.add_argument("--image-root", default="data/mimic_chexpert/images")
    ap.add_argument("--img-size", type=int, default=512)
    ap.add_argument("--batch-per-gpu", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=150)
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--cls-weight", type=float, default=0.5)
    ap.add_argument("--out", default="runs/densenet512")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    Trainer(args).fit()


if __name__ == "__main__":
    main()
