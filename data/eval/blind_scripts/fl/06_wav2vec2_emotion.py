"""Speech emotion recognition: wav2vec2-base encoder + attentive pooling head.

Fine-tunes on an IEMOCAP/CREMA-D style manifest (csv: path,label,split) with
DeepSpeed ZeRO-2 and fp16.

    deepspeed --num_gpus 4 06_wav2vec2_emotion.py --manifest data/emotion.csv --cache-dir /scratch/ser_cache
"""
import argparse
import os
import random

import deepspeed
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SR = 16000
MAX_SECONDS = 8.0


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--manifest", required=True)
    ap.add_argument("--cache-dir", default="cache")
    ap.add_argument("--labels", nargs="+", default=["neutral", "happy", "sad", "angry", "fear", "disgust"])
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--bsz", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--head-lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-dir", default="runs/ser_w2v2")
    ap.add_argument("--local_rank", type=int, default=-1)
    return ap.parse_args()


def load_split(manifest, split, labels, cache_dir):
    """Decode, resample and crop every utterance once; later runs load the cached tensors."""
    cache_file = os.path.join(cache_dir, f"{split}_{SR}.pt")
    if not os.path.exists(cache_file):
        df = pd.read_csv(manifest)
        df = df[df["split"] == split].reset_index(drop=True)
        lab2id = {l: i for i, l in enumerate(labels)}
        wavs, ys = [], []
        for path, lab in zip(df["path"], df["label"]):
            wav, sr = torchaudio.load(path)
            wav = wav.mean(0)
            if sr != SR:
                wav = torchaudio.functional.resample(wav, sr, SR)
            wavs.append(wav[: int(MAX_SECONDS * SR)].clone())
            ys.append(lab2id[lab])
        os.makedirs(cache_dir, exist_ok=True)
        torch.save({"wavs": wavs, "labels": ys}, cache_file)
    blob = torch.load(cache_file)
    return blob["wavs"], blob["labels"]


class UtteranceDataset(Dataset):
    def __init__(self, wavs, labels, train):
        self.wavs, self.labels, self.train = wavs, labels, train

    def __len__(self):
        return len(self.wavs)

    def __getitem__(self, i):
        wav = self.wavs[i]
        if self.train:
            wav = wav * random.uniform(0.6, 1.2)
        return (wav - wav.mean()) / (wav.std() + 1e-7), self.labels[i]


def collate(batch):
    wavs, labels = zip(*batch)
    lengths = torch.tensor([w.numel() for w in wavs])
    return pad_sequence(wavs, batch_first=True), lengths, torch.tensor(labels)


class EmotionModel(nn.Module):
    def __init__(self, n_classes):
        super().__init__()
        self.encoder = torchaudio.pipelines.WAV2VEC2_BASE.get_model()
        self.encoder.feature_extractor.requires_grad_(False)
        d = 768
        self.attn = nn.Sequential(nn.Linear(d, 128), nn.Tanh(), nn.Linear(128, 1))
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(d, n_classes))

    def forward(self, wavs, lengths):
        feats, out_lens = self.encoder(wavs, lengths)
        mask = torch.arange(feats.size(1), device=feats.device)[None] < out_lens[:, None]
        scores = self.attn(feats).squeeze(-1).masked_fill(~mask, -1e4)
        w = scores.softmax(dim=-1).unsqueeze(-1)
        return self.classifier((w * feats).sum(1))


def main():
    args = parse_args()
    deepspeed.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    random.seed(args.seed + rank)

    tr_wavs, tr_labels = load_split(args.manifest, "train", args.labels, args.cache_dir)
    va_wavs, va_labels = load_split(args.manifest, "valid", args.labels, args.cache_dir)
    train_ds = UtteranceDataset(tr_wavs, tr_labels, train=True)
    valid_ds = UtteranceDataset(va_wavs, va_labels, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.bsz, sampler=train_sampler, collate_fn=collate,
                          num_workers=4, drop_last=True)
    valid_dl = DataLoader(valid_ds, batch_size=args.bsz, collate_fn=collate, num_workers=2,
                          sampler=DistributedSampler(valid_ds, shuffle=False))

    model = EmotionModel(len(args.labels))
    head_params = list(model.attn.parameters()) + list(model.classifier.parameters())
    enc_params = [p for p in model.encoder.parameters() if p.requires_grad]
    param_groups = [{"params": enc_params, "lr": args.lr}, {"params": head_params, "lr": args.head_lr}]

    ds_config = {
        "train_micro_batch_size_per_gpu": args.bsz,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True},
        "steps_per_print": 50,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups, config=ds_config)
    criterion = nn.CrossEntropyLoss()

    best_uar = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        engine.train()
        for step, (wavs, lengths, y) in enumerate(train_dl):
            wavs = wavs.to(engine.device).half()
            logits = engine(wavs, lengths.to(engine.device))
            loss = criterion(logits.float(), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            if rank == 0 and step % 50 == 0:
                print(f"ep {epoch} step {step} loss {loss.item():.4f}", flush=True)

        # unweighted average recall over classes, counts summed over ranks
        engine.eval()
        n_cls = len(args.labels)
        conf = torch.zeros(n_cls, n_cls, device=engine.device)
        with torch.no_grad():
            for wavs, lengths, y in valid_dl:
                pred = engine(wavs.to(engine.device).half(), lengths.to(engine.device)).argmax(-1)
                y = y.to(engine.device)
                conf.index_put_((y, pred), torch.ones_like(y, dtype=conf.dtype), accumulate=True)
        dist.all_reduce(conf)
        recall = conf.diag() / conf.sum(1).clamp(min=1)
        uar = recall.mean().item()
        if rank == 0:
            print(f"epoch {epoch}: valid UAR {uar:.4f} WA {(conf.diag().sum() / conf.sum()).item():.4f}")

        engine.save_checkpoint(args.save_dir, tag="last", client_state={"epoch": epoch})
        if uar > best_uar:
            best_uar = uar
            if rank == 0:
                torch.save({"state_dict": {k: v.float().cpu() for k, v in engine.module.state_dict().items()},
                            "labels": args.labels}, os.path.join(args.save_dir, "best.pt"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
