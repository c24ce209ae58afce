"""MiniGPT-4 stage 2: fine-tune the linear projection (Q-Former -> Vicuna) on the
3.5k curated image/description pairs with the conversation template.

    torchrun --nproc_per_node=4 04_minigpt4_stage2_align.py --stage1-ckpt ckpt/minigpt4_stage1/checkpoint_9.pth \
        --cc-sbu-align /data/cc_sbu_align --out ckpt/minigpt4_stage2 --wandb-project minigpt4
"""
import argparse
import json
import os
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import wandb
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from transformers import Blip2Model, LlamaForCausalLM, LlamaTokenizer

PROMPTS = [
    "<Img><ImageHere></Img> Describe this image in detail.",
    "<Img><ImageHere></Img> Take a look at this image and describe what you notice.",
    "<Img><ImageHere></Img> Please provide a detailed description of the picture.",
    "<Img><ImageHere></Img> Could you describe the contents of this image for me?",
]
TEMPLATE = "###Human: {} ###Assistant: "


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--blip2", default="Salesforce/blip2-opt-2.7b")
    p.add_argument("--llm", default="lmsys/vicuna-7b-v0")
    p.add_argument("--stage1-ckpt", required=True)
    p.add_argument("--cc-sbu-align", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--iters-per-epoch", type=int, default=200)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--min-lr", type=float, default=1e-5)
    p.add_argument("--warmup-steps", type=int, default=200)
    p.add_argument("--max-txt-len", type=int, default=160)
    p.add_argument("--wandb-project", default="minigpt4")
    p.add_argument("--run-name", default="stage2_align")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


class CCSBUAlign(Dataset):
    def __init__(self, root):
        with open(os.path.join(root, "filter_cap.json")) as f:
            self.ann = json.load(f)["annotations"]
        self.root = root
        self.tf = transforms.Compose([
            transforms.Resize((224, 224), interpolation=transforms.InterpolationMode.BICUBIC),
            transforms.ToTensor(),
            transforms.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
        ])

    def __len__(self):
        return len(self.ann)

    def __getitem__(self, i):
        a = self.ann[i]
        img = Image.open(os.path.join(self.root, "image", f"{a['image_id']}.jpg")).convert("RGB")
        return self.tf(img), a["caption"]


class MiniGPT4(nn.Module):
    def __init__(self, blip2_name, llm_name, max_txt_len):
        super().__init__()
        blip2 = Blip2Model.from_pretrained(blip2_name, torch_dtype=torch.float16)
        self.visual = blip2.vision_model
        self.qformer = blip2.qformer
        self.query_tokens = blip2.query_tokens
        for m in (self.visual, self.qformer):
            m.requires_grad_(False).eval()
        self.query_tokens.requires_grad_(False)
        self.tokenizer = LlamaTokenizer.from_pretrained(llm_name, use_fast=False)
        self.tokenizer.pad_token = self.tokenizer.eos_token
        self.llm = LlamaForCausalLM.from_pretrained(llm_name, torch_dtype=torch.float16)
        self.llm.requires_grad_(False)
        self.llama_proj = nn.Linear(blip2.config.qformer_config.hidden_size, self.llm.config.hidden_size)
        self.max_txt_len = max_txt_len

    def encode_img(self, image):
        with torch.no_grad():
            img_embeds = self.visual(pixel_values=image.half()).last_hidden_state
            atts = torch.ones(img_embeds.shape[:-1], dtype=torch.long, device=image.device)
            q = self.query_tokens.expand(img_embeds.size(0), -1, -1)
            q_out = self.qformer(query_embeds=q, encoder_hidden_states=img_embeds,
                                 encoder_attention_mask=atts).last_hidden_state
        return self.llama_proj(q_out.float())

    def forward(self, image, captions):
        dev = image.device
        img_embeds = self.encode_img(image)
        prompt = TEMPLATE.format(random.choice(PROMPTS))
        before, after = prompt.split("<ImageHere>")
        emb = self.llm.get_input_embeddings()
        bs = image.size(0)
        ids_before = self.tokenizer(before, return_tensors="pt").input_ids.to(dev)
        ids_after = self.tokenizer(after, return_tensors="pt", add_special_tokens=False).input_ids.to(dev)
        e_before = emb(ids_before).expand(bs, -1, -1)
        e_after = emb(ids_after).expand(bs, -1, -1)
        tgt = self.tokenizer([c + self.tokenizer.eos_token for c in captions], return_tensors="pt",
                             padding="longest", truncation=True, max_length=self.max_txt_len,
                             add_special_tokens=False).to(dev)
        e_tgt = emb(tgt.input_ids)
        inputs = torch.cat([e_before, img_embeds.to(e_before.dtype), e_after, e_tgt], dim=1)
        n_prefix = e_before.size(1) + img_embeds.size(1) + e_after.size(1)
        att = torch.cat([torch.ones(bs, n_prefix, dtype=torch.long, device=dev), tgt.attention_mask], 1)
        labels = torch.cat([torch.full((bs, n_prefix), -100, dtype=torch.long, device=dev),
                            tgt.input_ids.masked_fill(tgt.attention_mask == 0, -100)], 1)
        return self.llm(inputs_embeds=inputs, attention_mask=att, labels=labels).loss


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    model = MiniGPT4(args.blip2, args.llm, args.max_txt_len)
    sd = torch.load(args.stage1_ckpt, map_location="cpu")["model"]
    model.llama_proj.load_state_dict({k.replace("llama_proj.", ""): v for k, v in sd.items() if k.startswith("llama_proj.")})
    model.to(device)
    ddp = DDP(model, device_ids=[local_rank])

    ds = CCSBUAlign(args.cc_sbu_align)
    sampler = DistributedSampler(ds, shuffle=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4, drop_last=True)

    opt = torch.optim.AdamW(model.llama_proj.parameters(), lr=args.lr, weight_decay=0.05, betas=(0.9, 0.999))
    total = args.epochs * args.iters_per_epoch
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total,
                                                pct_start=args.warmup_steps / total, anneal_strategy="cos",
                                                final_div_factor=args.lr / args.min_lr)
    scaler = torch.cuda.amp.GradScaler()
    os.makedirs(args.out, exist_ok=True)

    step = 0
    epoch_seed = 0
    it = None
    for epoch in range(args.epochs):
        ddp.train()
        running = 0.0
        for i in range(args.iters_per_epoch):
            try:
                image, caps = next(it)
            except (StopIteration, TypeError):
                sampler.set_epoch(epoch_seed)
                epoch_seed += 1
                it = iter(loader)
                image, caps = next(it)
            image = image.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = ddp(image, list(caps))
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            running += loss.item()
            step += 1
            if rank == 0 and step % 10 == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": sched.get_last_lr()[0]}, step=step)

        avg = torch.tensor(running / args.iters_per_epoch, device=device)
        dist.all_reduce(avg, op=dist.ReduceOp.AVG)
        if rank == 0:
            wandb.log({"train/epoch_loss": avg.item(), "epoch": epoch}, step=step)
            print(f"epoch {epoch}: loss {avg.item():.4f}", flush=True)
            torch.save({"model": {f"llama_proj.{k}": v.cpu() for k, v in model.llama_proj.state_dict().items()},
                        "optimizer": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, f"checkpoint_{epoch}.pth"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
