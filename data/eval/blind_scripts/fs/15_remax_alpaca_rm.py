"""ReMax: REINFORCE whose baseline is the reward of the greedy response.

Trains an SFT'd Pythia policy on Alpaca-style instructions against a reward model.
ReMax needs no value model, so memory is roughly policy + ref + RM.

    torchrun --nproc_per_node=8 15_remax_alpaca_rm.py --policy_path ckpts/pythia-1.4b-sft --rm_path ckpts/pythia-1.4b-rm
"""
import argparse
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

TEMPLATE = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
TEMPLATE_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"


def parse_args():
    parser = argparse.ArgumentParser(description="ReMax RLHF")
    parser.add_argument("--policy_path", type=str, required=True)
    parser.add_argument("--rm_path", type=str, required=True)
    parser.add_argument("--output_dir", type=str, default="ckpts/remax")
    parser.add_argument("--per_device_batch_size", type=int, default=8)
    parser.add_argument("--max_prompt_len", type=int, default=256)
    parser.add_argument("--max_gen_len", type=int, default=256)
    parser.add_argument("--learning_rate", type=float, default=1e-6)
    parser.add_argument("--kl_ctl", type=float, default=0.1)
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument("--save_interval", type=int, default=500)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


def set_random_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def format_prompt(ex):
    if ex["input"]:
        return TEMPLATE.format(instruction=ex["instruction"], input=ex["input"])
    return TEMPLATE_NO_INPUT.format(instruction=ex["instruction"])


def gen_mask(resp, eos_id):
    e = (resp == eos_id).int()
    return ((e.cumsum(1) - e) == 0).long()


def logprobs_from(model, ids, attn, P):
    logits = model(input_ids=ids, attention_mask=attn).logits[:, P - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, P:].unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def rm_score(rm, ids, attn):
    # our RM scores the hidden state of the last non-pad token (right padded input)
    out = rm(input_ids=ids, attention_mask=attn)
    return out.logits.squeeze(-1).float()


def right_pad(ids, attn, pad_id):
    # RM was trained on right-padded input; roll each row so padding moves to the end
    out_ids, out_attn = torch.full_like(ids, pad_id), torch.zeros_like(attn)
    for i in range(ids.size(0)):
        valid = ids[i][attn[i].bool()]
        out_ids[i, :valid.numel()] = valid
        out_attn[i, :valid.numel()] = 1
    return out_ids, out_attn


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    set_random_seed(args.seed + rank)

    tokenizer = AutoTokenizer.from_pretrained(args.policy_path, padding_side="left")
    tokenizer.pad_token = tokenizer.eos_token

    actor = AutoModelForCausalLM.from_pretrained(args.policy_path, torch_dtype=torch.bfloat16).to(device)
    ref = AutoModelForCausalLM.from_pretrained(args.policy_path, torch_dtype=torch.bfloat16).to(device)
    ref.eval()
    rm = AutoModelForSequenceClassification.from_pretrained(args.rm_path, num_labels=1,
                                                            torch_dtype=torch.bfloat16).to(device)
    rm.config.pad_token_id = tokenizer.pad_token_id
    rm.eval()
    for p in list(ref.parameters()) + list(rm.parameters()):
        p.requires_grad_(False)

    actor = DDP(actor, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.AdamW(actor.parameters(), lr=args.learning_rate, betas=(0.9, 0.95), weight_decay=0.0)

    data = load_dataset("tatsu-lab/alpaca", split="train")
    data = data.map(lambda ex: {"prompt": format_prompt(ex)}, remove_columns=data.column_names)
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(data, batch_size=args.per_device_batch_size, sampler=sampler, drop_last=True,
                        collate_fn=lambda b: [x["prompt"] for x in b])

    global_step = 0
    for epoch in range(args.num_train_epochs):
        sampler.set_epoch(epoch)
        pbar = tqdm(loader, disable=rank != 0, desc=f"epoch {epoch}")
        for prompts in pbar:
            enc = tokenizer(prompts, return_tensors="pt", padding=True, truncation=True,
                            max_length=args.max_prompt_len).to(device)
            P = enc.input_ids.size(1)
            actor.eval()
            with torch.no_grad():
                gen_kwargs = dict(max_new_tokens=args.max_gen_len, pad_token_id=tokenizer.pad_token_id)
                sampled = actor.module.generate(**enc, do_sample=True, top_p=1.0, temperature=1.0, **gen_kwargs)
                greedy = actor.module.generate(**enc, do_sample=False, **gen_kwargs)

                s_mask = gen_mask(sampled[:, P:], tokenizer.eos_token_id)
                g_mask = gen_mask(greedy[:, P:], tokenizer.eos_token_id)
                s_attn = torch.cat([enc.attention_mask, s_mask], 1)
                g_attn = torch.cat([enc.attention_mask, g_mask], 1)

                r_sample = rm_score(rm, *right_pad(sampled, s_attn, tokenizer.pad_token_id))
                r_greedy = rm_score(rm, *right_pad(greedy, g_attn, tokenizer.pad_token_id))
                ref_lp = logprobs_from(ref, sampled, s_attn, P)
            actor.train()

            lp = logprobs_from(actor, sampled, s_attn, P)
            kl = ((lp.detach() - ref_lp) * s_mask).sum(1)
            adv = (r_sample - r_greedy) - args.kl_ctl * kl
            loss = -(adv.detach() * (lp * s_mask).sum(1)).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(actor.parameters(), 1.0)
            optimizer.step()
            global_step += 1

            log_t = torch.stack([r_sample.mean(), r_greedy.mean(), kl.mean(), s_mask.sum(1).float().mean()])
            dist.all_reduce(log_t)
            log_t /= world_size
            if rank == 0:
                pbar.set_postfix(r=f"{log_t[0]:.3f}", r_greedy=f"{log_t[1]:.3f}", kl=f"{log_t[2]:.3f}",
                                 len=f"{log_t[3]:.0f}")

            if global_step % args.save_interval == 0:
                if rank == 0:
                    save_to = os.path.join(args.output_dir, f"step_{global_step}")
                    actor.module.save_pretrained(save_to)
                    tokenizer.save_pretrained(save_to)
                dist.barrier()

    if rank == 0:
        actor.module.save_pretrained(os.path.join(args.output_dir, "final"))
        tokenizer.save_pretrained(os.path.join(args.output_dir, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
