"""Pretrain a wav2vec2-base model from scratch with the Hugging Face
implementation, plain torch DDP (no accelerate / Trainer).

    torchrun --nproc_per_node 8 05_w2v2_hf_scratch.py --train_tsv data/train.tsv --valid_tsv data/dev.tsv
"""
import argparse
import math
import os
import random

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import (Wav2Vec2Config, Wav2Vec2FeatureExtractor, Wav2Vec2ForPreTraining,
                          get_linear_schedule_with_warmup)
from transformers.models.wav2vec2.modeling_wav2vec2 import _compute_mask_indices, _sample_negative_indices


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train_tsv", required=True)
    p.add_argument("--valid_tsv", required=True)
    p.add_argument("--output_dir", default="./w2v2-base-scratch")
    p.add_argument("--per_device_batch_size", type=int, default=8)
    p.add_argument("--gradient_accumulation_steps", type=int, default=4)
    p.add_argument("--learning_rate", type=float, default=5e-4)
    p.add_argument("--num_warmup_steps", type=int, default=32000)
    p.add_argument("--max_train_steps", type=int, default=200000)
    p.add_argument("--max_duration_in_seconds", type=float, default=20.0)
    p.add_argument("--min_duration_in_seconds", type=float, default=2.0)
    p.add_argument("--max_gumbel_temperature", type=float, default=2.0)
    p.add_argument("--min_gumbel_temperature", type=float, default=0.5)
    p.add_argument("--gumbel_temperature_decay", type=float, default=0.999995)
    p.add_argument("--mask_time_prob", type=float, default=0.65)
    p.add_argument("--mask_time_length", type=int, default=10)
    p.add_argument("--logging_steps", type=int, default=100)
    p.add_argument("--saving_steps", type=int, default=10000)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class TsvAudio(Dataset):
    def __init__(self, tsv, fe, min_s, max_s):
        with open(tsv) as f:
            root = f.readline().strip()
            rows = [line.rstrip("\n").split("\t") for line in f]
        sr = fe.sampling_rate
        self.paths = [os.path.join(root, p) for p, n in rows if min_s * sr <= int(n)]
        self.max_len = int(max_s * sr)
        self.fe = fe

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        wav, sr = sf.read(self.paths[i], dtype="float32")
        if len(wav) > self.max_len:
            s = random.randint(0, len(wav) - self.max_len)
            wav = wav[s:s + self.max_len]
        return self.fe(wav, sampling_rate=sr).input_values[0]


class PretrainCollator:
    """Pads a batch and draws time masks + negatives as in the HF pretraining example."""

    def __init__(self, model, fe, mask_prob, mask_len, num_negatives):
        self.model, self.fe = model, fe
        self.mask_prob, self.mask_len, self.num_neg = mask_prob, mask_len, num_negatives

    def __call__(self, feats):
        batch = self.fe.pad([{"input_values": f} for f in feats], padding=True, return_tensors="pt",
                            return_attention_mask=True)
        B = batch["input_values"].shape[0]
        T = int(self.model._get_feat_extract_output_lengths(batch["input_values"].shape[-1]))
        sub_mask = self.model._get_feature_vector_attention_mask(T, batch["attention_mask"])
        mask = _compute_mask_indices((B, T), self.mask_prob, self.mask_len, attention_mask=sub_mask,
                                     min_masks=2)
        neg = _sample_negative_indices((B, T), self.num_neg, mask_time_indices=mask)
        batch["mask_time_indices"] = torch.tensor(mask, dtype=torch.long)
        batch["sampled_negative_indices"] = torch.tensor(neg, dtype=torch.long)
        return batch


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    config = Wav2Vec2Config(
        do_stable_layer_norm=False, feat_extract_norm="group", conv_bias=False,
        num_codevector_groups=2, num_codevectors_per_group=320, codevector_dim=256, proj_codevector_dim=256,
        num_negatives=100, diversity_loss_weight=0.1, mask_time_prob=args.mask_time_prob,
        mask_time_length=args.mask_time_length, layerdrop=0.0, feat_quantizer_dropout=0.0,
        hidden_dropout=0.1, attention_dropout=0.1, activation_dropout=0.0,
    )
    fe = Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0,
                                  do_normalize=True, return_attention_mask=True)
    base = Wav2Vec2ForPreTraining(config).to(device)
    model = DDP(base, device_ids=[local_rank])

    collate = PretrainCollator(base, fe, config.mask_time_prob, config.mask_time_length, config.num_negatives)
    train_ds = TsvAudio(args.train_tsv, fe, args.min_duration_in_seconds, args.max_duration_in_seconds)
    valid_ds = TsvAudio(args.valid_tsv, fe, args.min_duration_in_seconds, args.max_duration_in_seconds)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.per_device_batch_size, sampler=train_sampler,
                          collate_fn=collate, num_workers=6, pin_memory=True, drop_last=True)
    valid_dl = DataLoader(torch.utils.data.Subset(valid_ds, range(rank, len(valid_ds), world)),
                          batch_size=args.per_device_batch_size, collate_fn=collate, num_workers=2)

    # learning rate given for 8 GPUs x 4 accumulation x 8 utterances
    lr = args.learning_rate * world * args.gradient_accumulation_steps / 32
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    scheduler = get_linear_schedule_with_warmup(optimizer, args.num_warmup_steps, args.max_train_steps)

    completed_steps, epoch = 0, 0
    model.train()
    while completed_steps < args.max_train_steps:
        train_sampler.set_epoch(epoch)
        for step, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            num_losses = batch["mask_time_indices"].sum()
            is_update = (step + 1) % args.gradient_accumulation_steps == 0
            ctx = model.no_sync() if not is_update else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = model(**batch)
                loss = out.loss / num_losses / args.gradient_accumulation_steps
                loss.backward()
            if not is_update:
                continue

            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            completed_steps += 1

            gumbel_temperature = max(
                args.max_gumbel_temperature * args.gumbel_temperature_decay ** completed_steps,
                args.min_gumbel_temperature)
            model.set_gumbel_temperature(gumbel_temperature)

            if completed_steps % args.logging_steps == 0:
                stats = torch.stack([out.contrastive_loss.detach() / num_losses,
                                     out.diversity_loss.detach() / num_losses,
                                     out.codevector_perplexity.detach().float()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {completed_steps} | contrastive {stats[0]:.4f} | div {stats[1]:.4f} | "
                          f"ppl {stats[2]:.1f} | temp {gumbel_temperature:.3f} | lr {scheduler.get_last_lr()[0]:.2e}",
                          flush=True)

            if completed_steps % args.saving_steps == 0:
                if rank == 0:
                    base.save_pretrained(os.path.join(args.output_dir, f"step_{completed_steps}"))
                    fe.save_pretrained(os.path.join(args.output_dir, f"step_{completed_steps}"))
                dist.barrier()
            if completed_steps >= args.max_train_steps:
                break
        epoch += 1

        # validation
        model.eval()
        tot = torch.zeros(3, device=device)
        with torch.no_grad():
            for batch in valid_dl:
                batch = {k: v.to(device) for k, v in batch.items()}
                out = base(**batch)
                tot += torch.stack([out.loss.float(), out.contrastive_loss.float(),
                                    batch["mask_time_indices"].sum().float()])
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch} | val loss {tot[0] / tot[2]:.4f} | val contrastive {tot[1] / tot[2]:.4f}",
                  flush=True)
        model.train()

    if rank == 0:
        base.save_pretrained(args.output_dir)
        fe.save_pretrained(args.output_dir)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
