"""Audio Spectrogram Transformer fine-tuning for AudioSet tagging (527 classes, mAP).

Data: json manifests {"data": [{"wav": path, "labels": "/m/09x0r,/m/05zppz"}, ...]} and the
class_labels_indices.csv from AudioSet.

    deepspeed --num_gpus 8 18_ast_audioset_tagging.py --train-json data/bal_train.json \
        --eval-json data/eval.json --label-csv data/class_labels_indices.csv
"""
import argparse
import csv
import json
import os
import random

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
from sklearn.metrics import average_precision_score
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import ASTConfig, ASTForAudioClassification

TARGET_FRAMES = 1024
FBANK_MEAN, FBANK_STD = -4.27, 4.57


def load_label_map(csv_path):
    with open(csv_path) as f:
        return {row["mid"]: int(row["index"]) for row in csv.DictReader(f)}


class AudioSetClips(Dataset):
    def __init__(self, manifest, label_map, train):
        with open(manifest) as f:
            self.items = json.load(f)["data"]
        self.label_map = label_map
        self.train = train
        self.freqm = torchaudio.transforms.FrequencyMasking(48)
        self.timem = torchaudio.transforms.TimeMasking(192)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        item = self.items[i]
        wav, sr = torchaudio.load(item["wav"])
        wav = wav - wav.mean()
        fbank = torchaudio.compliance.kaldi.fbank(wav, htk_compat=True, sample_frequency=sr, use_energy=False,
                                                  window_type="hanning", num_mel_bins=128, dither=0.0,
                                                  frame_shift=10)
        n = fbank.size(0)
        if n < TARGET_FRAMES:
            fbank = torch.nn.functional.pad(fbank, (0, 0, 0, TARGET_FRAMES - n))
        else:
            fbank = fbank[:TARGET_FRAMES]
        if self.train:
            spec = fbank.t().unsqueeze(0)
            spec = self.timem(self.freqm(spec))
            fbank = spec.squeeze(0).t()
            fbank = torch.roll(fbank, random.randint(-TARGET_FRAMES // 2, TARGET_FRAMES // 2), 0)
        fbank = (fbank - FBANK_MEAN) / (FBANK_STD * 2)
        target = torch.zeros(len(self.label_map))
        for mid in item["labels"].split(","):
            target[self.label_map[mid]] = 1.0
        return fbank, target


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-json", required=True)
    p.add_argument("--eval-json", required=True)
    p.add_argument("--label-csv", required=True)
    p.add_argument("--init", default="MIT/ast-finetuned-audioset-10-10-0.4593",
                   help="HF checkpoint to start from (ImageNet/AudioSet pretrained AST)")
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--out", default="exp/ast_audioset")
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


@torch.no_grad()
def evaluate_map(engine, loader):
    engine.eval()
    preds, targets = [], []
    for fbank, target in loader:
        logits = engine(input_values=fbank.to(engine.device).half()).logits
        preds.append(torch.sigmoid(logits.float()).cpu())
        targets.append(target)
    # keep the (N x 527) score matrices in host memory; eval set is ~20k clips
    preds, targets = torch.cat(preds), torch.cat(targets)
    world = dist.get_world_size()
    all_preds = [torch.zeros_like(preds) for _ in range(world)]
    all_targets = [torch.zeros_like(targets) for _ in range(world)]
    dist.all_gather(all_preds, preds)
    dist.all_gather(all_targets, targets)
    engine.train()
    p = torch.cat(all_preds).numpy()
    t = torch.cat(all_targets).numpy()
    valid = t.sum(0) > 0
    return float(np.mean(average_precision_score(t[:, valid], p[:, valid], average=None)))


def main():
    args = get_args()
    deepspeed.init_distributed()
    rank = dist.get_rank()

    label_map = load_label_map(args.label_csv)
    train_set = AudioSetClips(args.train_json, label_map, train=True)
    eval_set = AudioSetClips(args.eval_json, label_map, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=8, pin_memory=True, drop_last=True)
    eval_loader = DataLoader(eval_set, batch_size=48, sampler=DistributedSampler(eval_set, shuffle=False),
                             num_workers=8, pin_memory=True)

    config = ASTConfig.from_pretrained(args.init, num_labels=len(label_map))
    model = ASTForAudioClassification.from_pretrained(args.init, config=config, ignore_mismatched_sizes=True)

    steps_per_epoch = len(train_loader)
    ds_config = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.95, 0.999], "weight_decay": 5e-7}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr, "warmup_num_steps": 1000,
                                 "total_num_steps": steps_per_epoch * args.epochs}},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "gradient_clipping": 10.0,
        "steps_per_print": 200,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    bce = nn.BCEWithLogitsLoss()
    os.makedirs(args.out, exist_ok=True)

    best_map = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for step, (fbank, target) in enumerate(train_loader):
            fbank = fbank.to(engine.device, non_blocking=True).half()
            target = target.to(engine.device, non_blocking=True)
            logits = engine(input_values=fbank).logits
            loss = bce(logits.float(), target)
            engine.backward(loss)
            engine.step()
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step}/{steps_per_epoch} bce {loss.item():.5f}", flush=True)

        mAP = evaluate_map(engine, eval_loader)
        if rank == 0:
            print(f"epoch {epoch}: eval mAP {mAP:.4f}", flush=True)
        engine.save_checkpoint(args.out, tag=f"epoch{epoch}", client_state={"epoch": epoch, "mAP": mAP})
        if mAP > best_map:
            best_map = mAP
            if rank == 0:
                engine.module.save_pretrained(os.path.join(args.out, "best"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
