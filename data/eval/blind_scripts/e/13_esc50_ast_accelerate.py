"""
Fine-tune the Audio Spectrogram Transformer on ESC-50 (fold 5 held out) with accelerate.

    accelerate config            # once: multi-GPU, 4 processes, fp16
    accelerate launch 13_esc50_ast_accelerate.py --data_dir /data/ESC-50-master
"""
import argparse
import math
import os

import pandas as pd
import torch
import torch.nn.functional as F
import torchaudio
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm
from transformers import ASTFeatureExtractor, ASTForAudioClassification, get_cosine_schedule_with_warmup

CHECKPOINT = "MIT/ast-finetuned-audioset-10-10-0.4593"
TARGET_SR = 16000


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", default="/data/ESC-50-master")
    p.add_argument("--val_fold", type=int, default=5)
    p.add_argument("--per_device_batch_size", type=int, default=8)
    p.add_argument("--global_batch_size", type=int, default=48)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--warmup_frac", type=float, default=0.1)
    p.add_argument("--output_dir", default="runs/esc50_ast")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


class ESC50(Dataset):
    def __init__(self, root, folds, extractor, train):
        meta = pd.read_csv(os.path.join(root, "meta", "esc50.csv"))
        self.meta = meta[meta.fold.isin(folds)].reset_index(drop=True)
        self.root = root
        self.fx = extractor
        self.train = train

    def __len__(self):
        return len(self.meta)

    def __getitem__(self, i):
        row = self.meta.iloc[i]
        wav, sr = torchaudio.load(os.path.join(self.root, "audio", row.filename))
        wav = torchaudio.functional.resample(wav.mean(0), sr, TARGET_SR)
        if self.train:
            shift = torch.randint(-TARGET_SR // 2, TARGET_SR // 2, (1,)).item()
            wav = torch.roll(wav, shift) * (0.8 + 0.4 * torch.rand(1))
        feats = self.fx(wav.numpy(), sampling_rate=TARGET_SR, return_tensors="pt")["input_values"][0]
        return feats, int(row.target)


def main():
    args = parse_args()
    n_proc = int(os.environ.get("WORLD_SIZE", 1))  # set by accelerate launch
    accum = max(1, args.global_batch_size // (args.per_device_batch_size * n_proc))
    accelerator = Accelerator(gradient_accumulation_steps=accum, mixed_precision="fp16", log_with="tensorboard",
                              project_dir=args.output_dir)
    set_seed(args.seed)
    accelerator.init_trackers("esc50_ast", config=vars(args))
    accelerator.print(f"{accelerator.num_processes} processes, grad accumulation {accum}, "
                      f"effective batch {args.per_device_batch_size * accelerator.num_processes * accum}")

    fx = ASTFeatureExtractor.from_pretrained(CHECKPOINT)
    train_folds = [f for f in range(1, 6) if f != args.val_fold]
    train_ds = ESC50(args.data_dir, train_folds, fx, train=True)
    val_ds = ESC50(args.data_dir, [args.val_fold], fx, train=False)
    train_dl = DataLoader(train_ds, batch_size=args.per_device_batch_size, shuffle=True, num_workers=4, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=16, shuffle=False, num_workers=4)

    model = ASTForAudioClassification.from_pretrained(CHECKPOINT, num_labels=50, ignore_mismatched_sizes=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    model, optimizer, train_dl, val_dl = accelerator.prepare(model, optimizer, train_dl, val_dl)

    updates_per_epoch = math.ceil(len(train_dl) / accum)
    total_updates = updates_per_epoch * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_frac * total_updates), total_updates)

    best_acc, global_update = 0.0, 0
    for epoch in range(args.epochs):
        model.train()
        for x, y in tqdm(train_dl, disable=not accelerator.is_local_main_process, desc=f"epoch {epoch}"):
            with accelerator.accumulate(model):
                logits = model(input_values=x).logits
                loss = F.cross_entropy(logits, y, label_smoothing=0.1)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                scheduler.step()
                global_update += 1
                if global_update % 10 == 0:
                    accelerator.log({"train/loss": loss.item(), "lr": scheduler.get_last_lr()[0]}, step=global_update)

        model.eval()
        correct, total = 0, 0
        for x, y in val_dl:
            with torch.no_grad():
                pred = model(input_values=x).logits.argmax(-1)
            pred, y = accelerator.gather_for_metrics((pred, y))
            correct += (pred == y).sum().item()
            total += y.numel()
        acc = correct / total
        accelerator.print(f"epoch {epoch}: fold-{args.val_fold} accuracy {acc:.4f} ({total} clips)")
        accelerator.log({"val/acc": acc}, step=global_update)

        if acc > best_acc:
            best_acc = acc
            accelerator.wait_for_everyone()
            unwrapped = accelerator.unwrap_model(model)
            unwrapped.save_pretrained(os.path.join(args.output_dir, "best"), is_main_process=accelerator.is_main_process,
                                      save_function=accelerator.save)
            if accelerator.is_main_process:
                fx.save_pretrained(os.path.join(args.output_dir, "best"))

    accelerator.print(f"best accuracy {best_acc:.4f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
