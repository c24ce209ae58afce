#!/usr/bin/env python
# HuBERT-Large CTC fine-tuning on LibriSpeech 100h (character targets).
#
# Recipe follows the fairseq 100h fine-tuning config: frozen CNN front-end,
# time masking 0.075 / channel masking 0.008, LayerDrop 0.1, tri-stage LR.
import argparse
import contextlib
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from jiwer import wer as jiwer_wer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import HubertForCTC, Wav2Vec2CTCTokenizer, Wav2Vec2FeatureExtractor


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name", default="facebook/hubert-large-ll60k")
    p.add_argument("--tokenizer", default="facebook/wav2vec2-base-960h")
    p.add_argument("--cache_dir", default=None)
    p.add_argument("--save_dir", default="checkpoints/hubert_large_100h")
    p.add_argument("--per_gpu_batch", type=int, default=8)
    p.add_argument("--update_freq", type=int, default=2)
    p.add_argument("--max_updates", type=int, default=80000)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--phase_ratio", type=float, nargs=3, default=[0.1, 0.4, 0.5])
    p.add_argument("--freeze_finetune_updates", type=int, default=10000)
    p.add_argument("--layerdrop", type=float, default=0.1)
    p.add_argument("--mask_prob", type=float, default=0.075)
    p.add_argument("--mask_channel_prob", type=float, default=0.008)
    p.add_argument("--val_interval", type=int, default=2000)
    p.add_argument("--num_workers", type=int, default=6)
    return p.parse_args()


def tri_stage(step, total, ratios, init_scale=0.01, final_scale=0.05):
    warm, hold = int(total * ratios[0]), int(total * ratios[1])
    decay = total - warm - hold
    if step < warm:
        return init_scale + (1 - init_scale) * step / max(1, warm)
    if step < warm + hold:
        return 1.0
    progress = (step - warm - hold) / max(1, decay)
    return float(np.exp(np.log(final_scale) * min(progress, 1.0)))


class Collator:
    def __init__(self, feature_extractor, tokenizer):
        self.fe = feature_extractor
        self.tok = tokenizer

    def __call__(self, batch):
        audio = [b["audio"]["array"] for b in batch]
        inputs = self.fe(audio, sampling_rate=16000, padding=True, return_attention_mask=True,
                         return_tensors="pt")
        text = [b["text"].upper() for b in batch]
        lab = self.tok(text, padding=True, return_tensors="pt", return_attention_mask=True)
        labels = lab.input_ids.masked_fill(lab.attention_mask.eq(0), -100)
        return inputs.input_values, inputs.attention_mask, labels, text


def decode(logits, tokenizer):
    ids = logits.argmax(-1)
    return tokenizer.batch_decode(ids)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    master = rank == 0

    tokenizer = Wav2Vec2CTCTokenizer.from_pretrained(args.tokenizer)
    fe = Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0,
                                  do_normalize=True, return_attention_mask=True)

    if not master:
        dist.barrier()
    train = load_dataset("librispeech_asr", "clean", split="train.100", cache_dir=args.cache_dir)
    valid = load_dataset("librispeech_asr", "other", split="validation", cache_dir=args.cache_dir)
    if master:
        dist.barrier()

    collate = Collator(fe, tokenizer)
    sampler = DistributedSampler(train, num_replicas=world_size, rank=rank, shuffle=True, seed=1)
    train_loader = DataLoader(train, batch_size=args.per_gpu_batch, sampler=sampler, collate_fn=collate,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(Subset(valid, range(rank, len(valid), world_size)), batch_size=16,
                              collate_fn=collate, num_workers=2)

    model = HubertForCTC.from_pretrained(
        args.model_name,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        ctc_loss_reduction="sum",
        ctc_zero_infinity=True,
        layerdrop=args.layerdrop,
        mask_time_prob=args.mask_prob,
        mask_time_length=10,
        mask_feature_prob=args.mask_channel_prob,
        mask_feature_length=64,
        final_dropout=0.0,
        hidden_dropout=0.0,
        activation_dropout=0.1,
        attention_dropout=0.0,
    )
    model.freeze_feature_encoder()
    model = model.to(device)
    ddp_model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optim = torch.optim.Adam([p for p in model.parameters() if p.requires_grad],
                             lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: tri_stage(s, args.max_updates, args.phase_ratio))
    scaler = torch.cuda.amp.GradScaler()

    os.makedirs(args.save_dir, exist_ok=True)
    updates, epoch, micro = 0, 0, 0
    best = 1.0
    t_start = time.time()
    while updates < args.max_updates:
        sampler.set_epoch(epoch)
        ddp_model.train()
        for wav, att, labels, _ in train_loader:
            wav, att, labels = wav.to(device), att.to(device), labels.to(device)
            # the transformer stays frozen for the first updates, only the CTC head trains
            freeze_encoder = updates < args.freeze_finetune_updates
            micro += 1
            accumulate = micro % args.update_freq != 0
            ctx = ddp_model.no_sync() if accumulate else contextlib.nullcontext()
            with ctx:
                with torch.autocast("cuda", dtype=torch.float16):
                    out = ddp_model(wav, attention_mask=att, labels=labels)
                n_tokens = (labels >= 0).sum()
                loss = out.loss / n_tokens.clamp(min=1)
                scaler.scale(loss / args.update_freq).backward()
            if accumulate:
                continue
            if freeze_encoder:
                for n, p in model.named_parameters():
                    if p.grad is not None and not n.startswith("lm_head"):
                        p.grad = None
            scaler.unscale_(optim)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1000.0)
            scaler.step(optim)
            scaler.update()
            optim.zero_grad(set_to_none=True)
            sched.step()
            updates += 1

            if master and updates % 200 == 0:
                elapsed = time.time() - t_start
                print(json.dumps({"update": updates, "loss": round(loss.item(), 4),
                                  "lr": sched.get_last_lr()[0], "elapsed_s": int(elapsed)}), flush=True)

            if updates % args.val_interval == 0:
                model.eval()
                hyps, refs = [], []
                with torch.no_grad():
                    for v_wav, v_att, _, v_text in valid_loader:
                        logits = model(v_wav.to(device), attention_mask=v_att.to(device)).logits
                        hyps += decode(logits, tokenizer)
                        refs += v_text
                model.train()
                gathered = [None] * world_size
                dist.all_gather_object(gathered, (hyps, refs))
                if master:
                    all_h = [h for g in gathered for h in g[0]]
                    all_r = [r for g in gathered for r in g[1]]
                    score = jiwer_wer(all_r, all_h)
                    print(json.dumps({"update": updates, "dev_other_wer": round(100 * score, 2)}), flush=True)
                    model.save_pretrained(os.path.join(args.save_dir, "last"))
                    if score < best:
                        best = score
                        model.save_pretrained(os.path.join(args.save_dir, "best"))
                dist.barrier()
            if updates >= args.max_updates:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
