#!/usr/bin/env python
# coding=utf-8
"""wav2vec2 pretraining with 🤗 Accelerate, tracked in Weights & Biases.

    accelerate launch --multi_gpu --num_machines 1 --num_processes 8 --mixed_precision bf16 \
        15_w2v2_accelerate_pretrain.py --train_manifest data/train.tsv --eval_manifest data/dev.tsv \
        --output_dir runs/w2v2-base-ls960
"""
import argparse
import math
import os
import random

import numpy as np
import soundfile as sf
import torch
import wandb
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset
from transformers import Wav2Vec2Config, Wav2Vec2FeatureExtractor, Wav2Vec2ForPreTraining, get_scheduler
from transformers.models.wav2vec2.modeling_wav2vec2 import _compute_mask_indices, _sample_negative_indices

logger = get_logger(__name__)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train_manifest", required=True)
    p.add_argument("--eval_manifest", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--per_device_train_batch_size", type=int, default=8)
    p.add_argument("--per_device_eval_batch_size", type=int, default=8)
    p.add_argument("--gradient_accumulation_steps", type=int, default=8)
    p.add_argument("--learning_rate", type=float, default=5e-4)  # for 8 processes x 8 accum x 8 utterances
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--num_train_epochs", type=int, default=100)
    p.add_argument("--num_warmup_steps", type=int, default=32000)
    p.add_argument("--max_duration_in_seconds", type=float, default=15.6)
    p.add_argument("--min_duration_in_seconds", type=float, default=2.0)
    p.add_argument("--max_gumbel_temperature", type=float, default=2.0)
    p.add_argument("--min_gumbel_temperature", type=float, default=0.5)
    p.add_argument("--gumbel_temperature_decay", type=float, default=0.999995)
    p.add_argument("--logging_steps", type=int, default=50)
    p.add_argument("--checkpointing_steps", type=int, default=5000)
    p.add_argument("--wandb_project", default="w2v2-pretraining")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


class ManifestDataset(Dataset):
    def __init__(self, path, fe, min_s, max_s):
        with open(path) as f:
            root = f.readline().strip()
            rows = [l.rstrip("\n").split("\t") for l in f]
        sr = fe.sampling_rate
        self.files = [os.path.join(root, r[0]) for r in rows if int(r[1]) >= min_s * sr]
        self.max_samples = int(max_s * sr)
        self.fe = fe

    def __len__(self):
        return len(self.files)

    def __getitem__(self, idx):
        audio, sr = sf.read(self.files[idx], dtype="float32")
        if len(audio) > self.max_samples:
            start = random.randint(0, len(audio) - self.max_samples)
            audio = audio[start:start + self.max_samples]
        return {"input_values": self.fe(audio, sampling_rate=sr).input_values[0]}


class DataCollatorForWav2Vec2Pretraining:
    def __init__(self, config, fe):
        self.config, self.fe = config, fe

    def _feat_lengths(self, lengths):
        for k, s in zip(self.config.conv_kernel, self.config.conv_stride):
            lengths = torch.div(lengths - k, s, rounding_mode="floor") + 1
        return lengths

    def __call__(self, features):
        batch = self.fe.pad(features, padding="longest", return_tensors="pt", return_attention_mask=True)
        B, L = batch["input_values"].shape
        T = int(self._feat_lengths(torch.tensor(L)))
        out_lens = self._feat_lengths(batch["attention_mask"].sum(-1))
        sub_mask = (torch.arange(T)[None, :] < out_lens[:, None]).long()
        mask_time_indices = _compute_mask_indices((B, T), self.config.mask_time_prob, self.config.mask_time_length,
                                                  attention_mask=sub_mask)
        neg = _sample_negative_indices((B, T), self.config.num_negatives, mask_time_indices=mask_time_indices)
        batch["mask_time_indices"] = torch.tensor(mask_time_indices, dtype=torch.long)
        batch["sampled_negative_indices"] = torch.tensor(neg, dtype=torch.long)
        return batch


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(args.seed)

    wandb.init(project=args.wandb_project, name=os.path.basename(args.output_dir), config=vars(args))

    config = Wav2Vec2Config(feat_extract_norm="group", do_stable_layer_norm=False, conv_bias=False,
                            num_negatives=100, codevector_dim=256, proj_codevector_dim=256,
                            diversity_loss_weight=0.1, mask_time_prob=0.65, mask_time_length=10,
                            layerdrop=0.0, feat_quantizer_dropout=0.0)
    fe = Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0, do_normalize=True,
                                  return_attention_mask=True)
    model = Wav2Vec2ForPreTraining(config)

    train_ds = ManifestDataset(args.train_manifest, fe, args.min_duration_in_seconds, args.max_duration_in_seconds)
    eval_ds = ManifestDataset(args.eval_manifest, fe, args.min_duration_in_seconds, args.max_duration_in_seconds)
    collator = DataCollatorForWav2Vec2Pretraining(config, fe)
    train_dl = DataLoader(train_ds, shuffle=True, batch_size=args.per_device_train_batch_size,
                          collate_fn=collator, num_workers=6, pin_memory=True)
    # evaluation shard per process, no padding/duplication; sums are reduced afterwards
    eval_shard = torch.utils.data.Subset(eval_ds, range(accelerator.process_index, len(eval_ds),
                                                        accelerator.num_processes))
    eval_dl = DataLoader(eval_shard, batch_size=args.per_device_eval_batch_size, collate_fn=collator, num_workers=2)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.98), eps=1e-6,
                                  weight_decay=args.weight_decay)
    model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)

    updates_per_epoch = math.ceil(len(train_dl) / args.gradient_accumulation_steps)
    max_train_steps = args.num_train_epochs * updates_per_epoch
    lr_scheduler = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=args.num_warmup_steps,
                                 num_training_steps=max_train_steps)
    logger.info(f"{len(train_ds)} training utterances, {max_train_steps} optimizer steps", main_process_only=True)

    completed_steps = 0
    for epoch in range(args.num_train_epochs):
        model.train()
        train_dl.set_epoch(epoch)
        for batch in train_dl:
            with accelerator.accumulate(model):
                num_losses = batch["mask_time_indices"].sum()
                outputs = model(**batch)
                loss = outputs.loss / num_losses
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()

            if not accelerator.sync_gradients:
                continue
            lr_scheduler.step()
            completed_steps += 1
            temp = max(args.max_gumbel_temperature * args.gumbel_temperature_decay ** completed_steps,
                       args.min_gumbel_temperature)
            accelerator.unwrap_model(model).set_gumbel_temperature(temp)

            if completed_steps % args.logging_steps == 0:
                stats = accelerator.reduce(torch.stack([outputs.contrastive_loss.detach() / num_losses,
                                                        outputs.diversity_loss.detach() / num_losses,
                                                        outputs.codevector_perplexity.detach().float()]),
                                           reduction="mean")
                wandb.log({"train/contrastive_loss": stats[0].item(), "train/diversity_loss": stats[1].item(),
                           "train/codevector_ppl": stats[2].item(), "train/gumbel_temp": temp,
                           "train/lr": lr_scheduler.get_last_lr()[0], "epoch": epoch}, step=completed_steps)

            if completed_steps % args.checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{completed_steps}"))

        model.eval()
        net = accelerator.unwrap_model(model)
        totals = torch.zeros(3, device=accelerator.device)
        for batch in eval_dl:
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            with torch.no_grad(), accelerator.autocast():
                outputs = net(**batch)
            totals += torch.stack([outputs.loss.detach().float(), outputs.contrastive_loss.detach().float(),
                                   batch["mask_time_indices"].sum().float()])
        totals = accelerator.reduce(totals, reduction="sum")
        wandb.log({"eval/loss": (totals[0] / totals[2]).item(),
                   "eval/contrastive_loss": (totals[1] / totals[2]).item()}, step=completed_steps)

        accelerator.wait_for_everyone()
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process,
                                  save_function=accelerator.save)
        if accelerator.is_main_process:
            fe.save_pretrained(args.output_dir)

    accelerator.end_training()
    wandb.finish()


if __name__ == "__main__":
    main()
