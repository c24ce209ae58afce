"""PaliGemma VQAv2 fine-tuning, FSDP full-shard, SigLIP tower frozen.

    torchrun --standalone --nproc_per_node=8 05_paligemma_vqa_wandb.py \
        --train data/vqav2_train.jsonl --val data/vqav2_val_subset.jsonl --run-name pg-vqa-448
"""
import argparse
import functools
import json
import os
import re
import time

import torch
import torch.distributed as dist
import wandb
from PIL import Image
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoProcessor, PaliGemmaForConditionalGeneration
from transformers.models.gemma.modeling_gemma import GemmaDecoderLayer
from transformers.models.siglip.modeling_siglip import SiglipEncoderLayer


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model-id", default="google/paligemma-3b-pt-448")
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--image-dir", default="/datasets/coco2014")
    p.add_argument("--run-name", default="paligemma-vqa")
    p.add_argument("--wandb-project", default="vlm-finetune")
    p.add_argument("--save-dir", default="checkpoints")
    p.add_argument("--bs", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=1000)
    return p.parse_args()


class VQAJsonl(Dataset):
    def __init__(self, path, image_dir):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.image_dir = image_dir

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        img = Image.open(os.path.join(self.image_dir, r["image"])).convert("RGB")
        return img, "answer en " + r["question"], r["answer"]


def collate_train(processor):
    def fn(batch):
        imgs, qs, ans = zip(*batch)
        return processor(text=list(qs), images=list(imgs), suffix=list(ans),
                         return_tensors="pt", padding="longest")
    return fn


def collate_eval(processor):
    def fn(batch):
        imgs, qs, ans = zip(*batch)
        enc = processor(text=list(qs), images=list(imgs), return_tensors="pt", padding="longest")
        return enc, list(ans)
    return fn


def normalize(a):
    a = a.lower().strip()
    a = re.sub(r"[^\w\s]", "", a)
    return " ".join(w for w in a.split() if w not in {"a", "an", "the"})


@torch.no_grad()
def vqa_accuracy(model, loader, processor, device):
    model.eval()
    correct = torch.zeros(2, device=device)
    for enc, answers in loader:
        enc = enc.to(device)
        # one greedy decoding step per token through the FSDP root forward
        ids, mask, pix = enc["input_ids"], enc["attention_mask"], enc["pixel_values"].to(torch.bfloat16)
        generated = []
        for _ in range(8):
            logits = model(input_ids=ids, attention_mask=mask, pixel_values=pix).logits[:, -1]
            nxt = logits.argmax(-1, keepdim=True)
            generated.append(nxt)
            ids = torch.cat([ids, nxt], dim=1)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        gen = torch.cat(generated, dim=1)
        preds = processor.batch_decode(gen, skip_special_tokens=True)
        for p, a in zip(preds, answers):
            correct[0] += float(normalize(p) == normalize(a))
            correct[1] += 1
    dist.all_reduce(correct)
    model.train()
    return (correct[0] / correct[1]).item()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    processor = AutoProcessor.from_pretrained(args.model_id)
    model = PaliGemmaForConditionalGeneration.from_pretrained(args.model_id, torch_dtype=torch.float32)
    model.vision_tower.requires_grad_(False)

    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={GemmaDecoderLayer, SiglipEncoderLayer})
    model = FSDP(model, auto_wrap_policy=policy, device_id=device, use_orig_params=True,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.bfloat16))

    train_ds, val_ds = VQAJsonl(args.train, args.image_dir), VQAJsonl(args.val, args.image_dir)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=6,
                              collate_fn=collate_train(processor), drop_last=True, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=args.bs, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=4, collate_fn=collate_eval(processor))

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=args.lr, weight_decay=0.0, betas=(0.9, 0.999))
    steps_per_epoch = len(train_loader) // args.grad_accum
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr,
                                                    total_steps=args.epochs * steps_per_epoch, pct_start=0.05)

    opt_step = 0
    t_last = time.time()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for i, batch in enumerate(train_loader):
            batch = batch.to(device)
            batch["pixel_values"] = batch["pixel_values"].to(torch.bfloat16)
            sync = (i + 1) % args.grad_accum == 0
            if sync:
                loss = model(**batch).loss / args.grad_accum
                loss.backward()
            else:
                with model.no_sync():
                    loss = model(**batch).loss / args.grad_accum
                    loss.backward()
            if not sync:
                continue
            gnorm = model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            opt_step += 1

            if opt_step % args.log_every == 0:
                dt = time.time() - t_last
                t_last = time.time()
                wandb.log({"train/loss": loss.item() * args.grad_accum, "train/grad_norm": gnorm.item(),
                           "train/lr": scheduler.get_last_lr()[0],
                           "perf/s_per_step": dt / args.log_every, "epoch": epoch}, step=opt_step)

            if opt_step % args.eval_every == 0:
                acc = vqa_accuracy(model, val_loader, processor, device)
                wandb.log({"val/vqa_acc": acc}, step=opt_step)
                if rank == 0:
                    print(f"step {opt_step}: val acc {acc:.4f}", flush=True)

    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        state = model.state_dict()
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        torch.save(state, os.path.join(args.save_dir, f"{args.run_name}.pt"))
        print("done", flush=True)
    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
