"""
InternVL2-2B SFT on chart QA, single 448px tile per image (no dynamic tiling: charts are small).
ViT frozen, MLP projector + LLM full fine-tune. Plain torch DDP, resumable.

torchrun --nproc_per_node=8 10_internvl2_chart_sft.py --meta data/chartqa_train.jsonl \
    --image_root data/chartqa/png --output_dir work_dirs/internvl2_2b_chart --resume
"""
import argparse
import glob
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.transforms.functional import InterpolationMode
from transformers import AutoModel, AutoTokenizer, get_cosine_schedule_with_warmup

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMG_START_TOKEN, IMG_END_TOKEN, IMG_CONTEXT_TOKEN = "<img>", "</img>", "<IMG_CONTEXT>"
IGNORE_INDEX = -100


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_path", default="OpenGVLab/InternVL2-2B")
    ap.add_argument("--meta", required=True)
    ap.add_argument("--image_root", required=True)
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=4e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--max_len", type=int, default=1024)
    ap.add_argument("--save_interval", type=int, default=500)
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args()


def build_transform(size=448):
    return T.Compose([
        T.Lambda(lambda img: img.convert("RGB")),
        T.Resize((size, size), interpolation=InterpolationMode.BICUBIC),
        T.ToTensor(),
        T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ])


class ChartSFT(Dataset):
    def __init__(self, meta, image_root, tokenizer, num_image_token, max_len):
        self.rows = [json.loads(l) for l in open(meta)]
        self.image_root = image_root
        self.tok = tokenizer
        self.num_image_token = num_image_token
        self.max_len = max_len
        self.tf = build_transform()

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        pix = self.tf(Image.open(os.path.join(self.image_root, r["image"])))
        img_tokens = IMG_START_TOKEN + IMG_CONTEXT_TOKEN * self.num_image_token + IMG_END_TOKEN
        # internlm2-chat template
        q = f"<|im_start|>user\n{img_tokens}\n{r['question']}<|im_end|>\n<|im_start|>assistant\n"
        a = f"{r['answer']}<|im_end|>\n"
        q_ids = self.tok(q, add_special_tokens=True).input_ids
        a_ids = self.tok(a, add_special_tokens=False).input_ids
        ids = (q_ids + a_ids)[: self.max_len]
        labels = ([IGNORE_INDEX] * len(q_ids) + a_ids)[: self.max_len]
        return torch.tensor(ids), torch.tensor(labels), pix


def make_collate(pad_id):
    def collate(batch):
        ids = torch.nn.utils.rnn.pad_sequence([b[0] for b in batch], batch_first=True, padding_value=pad_id)
        labels = torch.nn.utils.rnn.pad_sequence([b[1] for b in batch], batch_first=True, padding_value=IGNORE_INDEX)
        pix = torch.stack([b[2] for b in batch])
        return ids, labels, ids.ne(pad_id), pix
    return collate


def latest_checkpoint(output_dir):
    ckpts = glob.glob(os.path.join(output_dir, "ckpt_step*.pt"))
    if not ckpts:
        return None
    return max(ckpts, key=lambda p: int(os.path.basename(p)[len("ckpt_step"):-3]))


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")

    tokenizer = AutoTokenizer.from_pretrained(args.model_path, trust_remote_code=True, use_fast=False)
    model = AutoModel.from_pretrained(args.model_path, torch_dtype=torch.bfloat16, trust_remote_code=True,
                                      use_flash_attn=True)
    model.img_context_token_id = tokenizer.convert_tokens_to_ids(IMG_CONTEXT_TOKEN)
    model.vision_model.requires_grad_(False)
    model.language_model.config.use_cache = False
    model.language_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    ds = ChartSFT(args.meta, args.image_root, tokenizer, model.module.num_image_token, args.max_len)
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=6, pin_memory=True,
                    drop_last=True, collate_fn=make_collate(tokenizer.pad_token_id))

    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.05, betas=(0.9, 0.999))
    total_steps = len(dl) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, int(0.03 * total_steps), total_steps)

    step, start_epoch = 0, 0
    if args.resume:
        ckpt_path = latest_checkpoint(args.output_dir)
        if ckpt_path is not None:
            ckpt = torch.load(ckpt_path)
            model.module.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optimizer"])
            sched.load_state_dict(ckpt["scheduler"])
            step, start_epoch = ckpt["step"], ckpt["epoch"]
            del ckpt
            if rank == 0:
                print(f"resumed from {ckpt_path} at step {step}", flush=True)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    steps_per_epoch = len(dl)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        skip = step - epoch * steps_per_epoch
        t0 = time.time()
        for it, (ids, labels, attn, pix) in enumerate(dl):
            if it < skip:
                continue
            ids, labels, attn = ids.to(device), labels.to(device), attn.to(device)
            pix = pix.to(device, dtype=torch.bfloat16)
            image_flags = torch.ones(pix.shape[0], 1, dtype=torch.long, device=device)
            out = model(pixel_values=pix, input_ids=ids, attention_mask=attn, image_flags=image_flags, labels=labels)
            loss = out.loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l)
                if rank == 0:
                    print(f"[ep {epoch}] step {step}/{total_steps} loss {l.item() / world:.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 10:.2f}s/it", flush=True)
                    t0 = time.time()

            if step % args.save_interval == 0:
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                                "scheduler": sched.state_dict(), "step": step, "epoch": epoch},
                               os.path.join(args.output_dir, f"ckpt_step{step}.pt"))
                dist.barrier()

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.output_dir, "final"))
        tokenizer.save_pretrained(os.path.join(args.output_dir, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
