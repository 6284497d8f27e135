"""Writes the local lm-eval task data (JSONL) next to this file, deterministically: public
task data cannot be downloaded here, so these are small zh/en tasks with known answers.

    python benchmarks/lm_eval_tasks/make_tasks.py

- arith_{en,zh}: two-number addition/subtraction, 4 choices (the answer, off by one,
  off by ten, digits swapped) - 150 items each;
- capitals_{en,zh}: capitals of countries (and, in zh, of Chinese provinces), 4 choices
  drawn from the other capitals - 60 and 90 items;
- arith_gen_en: 50 additions answered by free generation (exact match), so the harness
  also drives the generation path.
"""

from __future__ import annotations

import json
import os
import random

# (country, capital, 国家, 首都)
COUNTRIES = [
    ("France", "Paris", "法国", "巴黎"), ("Germany", "Berlin", "德国", "柏林"), ("Italy", "Rome", "意大利", "罗马"),
    ("Spain", "Madrid", "西班牙", "马德里"), ("Portugal", "Lisbon", "葡萄牙", "里斯本"),
    ("United Kingdom", "London", "英国", "伦敦"), ("Ireland", "Dublin", "爱尔兰", "都柏林"),
    ("Netherlands", "Amsterdam", "荷兰", "阿姆斯特丹"), ("Belgium", "Brussels", "比利时", "布鲁塞尔"),
    ("Austria", "Vienna", "奥地利", "维也纳"), ("Switzerland", "Bern", "瑞士", "伯尔尼"),
    ("Poland", "Warsaw", "波兰", "华沙"), ("Czech Republic", "Prague", "捷克", "布拉格"),
    ("Hungary", "Budapest", "匈牙利", "布达佩斯"), ("Greece", "Athens", "希腊", "雅典"),
    ("Sweden", "Stockholm", "瑞典", "斯德哥尔摩"), ("Norway", "Oslo", "挪威", "奥斯陆"),
    ("Denmark", "Copenhagen", "丹麦", "哥本哈根"), ("Finland", "Helsinki", "芬兰", "赫尔辛基"),
    ("Russia", "Moscow", "俄罗斯", "莫斯科"), ("Ukraine", "Kyiv", "乌克兰", "基辅"),
    ("Turkey", "Ankara", "土耳其", "安卡拉"), ("Egypt", "Cairo", "埃及", "开罗"),
    ("Kenya", "Nairobi", "肯尼亚", "内罗毕"), ("Nigeria", "Abuja", "尼日利亚", "阿布贾"),
    ("Ethiopia", "Addis Ababa", "埃塞俄比亚", "亚的斯亚贝巴"), ("Morocco", "Rabat", "摩洛哥", "拉巴特"),
    ("South Africa", "Pretoria", "南非", "比勒陀利亚"), ("China", "Beijing", "中国", "北京"),
    ("Japan", "Tokyo", "日本", "东京"), ("South Korea", "Seoul", "韩国", "首尔"),
    ("India", "New Delhi", "印度", "新德里"), ("Pakistan", "Islamabad", "巴基斯坦", "伊斯兰堡"),
    ("Thailand", "Bangkok", "泰国", "曼谷"), ("Vietnam", "Hanoi", "越南", "河内"),
    ("Indonesia", "Jakarta", "印度尼西亚", "雅加达"), ("Malaysia", "Kuala Lumpur", "马来西亚", "吉隆坡"),
    ("Philippines", "Manila", "菲律宾", "马尼拉"), ("Singapore", "Singapore", "新加坡", "新加坡"),
    ("Mongolia", "Ulaanbaatar", "蒙古", "乌兰巴托"), ("Iran", "Tehran", "伊朗", "德黑兰"),
    ("Iraq", "Baghdad", "伊拉克", "巴格达"), ("Saudi Arabia", "Riyadh", "沙特阿拉伯", "利雅得"),
    ("Israel", "Jerusalem", "以色列", "耶路撒冷"), ("Australia", "Canberra", "澳大利亚", "堪培拉"),
    ("New Zealand", "Wellington", "新西兰", "惠灵顿"), ("Canada", "Ottawa", "加拿大", "渥太华"),
    ("United States", "Washington", "美国", "华盛顿"), ("Mexico", "Mexico City", "墨西哥", "墨西哥城"),
    ("Cuba", "Havana", "古巴", "哈瓦那"), ("Brazil", "Brasilia", "巴西", "巴西利亚"),
    ("Argentina", "Buenos Aires", "阿根廷", "布宜诺斯艾利斯"), ("Chile", "Santiago", "智利", "圣地亚哥"),
    ("Peru", "Lima", "秘鲁", "利马"), ("Colombia", "Bogota", "哥伦比亚", "波哥大"),
    ("Venezuela", "Caracas", "委内瑞拉", "加拉加斯"), ("Nepal", "Kathmandu", "尼泊尔", "加德满都"),
    ("Afghanistan", "Kabul", "阿富汗", "喀布尔"), ("Syria", "Damascus", "叙利亚", "大马士革"),
    ("Cambodia", "Phnom Penh", "柬埔寨", "金边"),
]
PROVINCES = [  # 省份, 省会
    ("河北", "石家庄"), ("山西", "太原"), ("辽宁", "沈阳"), ("吉林", "长春"), ("黑龙江", "哈尔滨"),
    ("江苏", "南京"), ("浙江", "杭州"), ("安徽", "合肥"), ("福建", "福州"), ("江西", "南昌"),
    ("山东", "济南"), ("河南", "郑州"), ("湖北", "武汉"), ("湖南", "长沙"), ("广东", "广州"),
    ("海南", "海口"), ("四川", "成都"), ("贵州", "贵阳"), ("云南", "昆明"), ("陕西", "西安"),
    ("甘肃", "兰州"), ("青海", "西宁"), ("台湾", "台北"), ("内蒙古", "呼和浩特"), ("广西", "南宁"),
    ("西藏", "拉萨"), ("宁夏", "银川"), ("新疆", "乌鲁木齐"),
]


def arith(rng: random.Random, zh: bool) -> dict:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    plus = rng.random() < 0.6
    ans = a + b if plus else a - b
    wrong = {ans + 1, ans - 1, ans + 10, ans - 10, int(str(abs(ans))[::-1]) * (1 if ans >= 0 else -1)} - {ans}
    choices = [ans] + rng.sample(sorted(wrong), 3)
    rng.shuffle(choices)
    if zh:
        q = f"问题：{a}{'加' if plus else '减'}{b}等于多少？\n答案："
    else:
        q = f"Question: What is {a} {'plus' if plus else 'minus'} {b}?\nAnswer:"
    return {"question": q, "choices": [str(c) for c in choices], "answer": choices.index(ans)}


def capital(rng: random.Random, item: tuple[str, str], pool: list[str], zh: bool, province: bool = False) -> dict:
    place, cap = item
    choices = [cap] + rng.sample([c for c in pool if c != cap], 3)
    rng.shuffle(choices)
    if zh:
        q = f"问题：{place}的{'省会' if province else '首都'}是哪里？\n答案："
    else:
        q = f"Question: What is the capital of {place}?\nAnswer:"
    return {"question": q, "choices": choices, "answer": choices.index(cap)}


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rng = random.Random(20261130)
    tasks = {
        "arith_en": [arith(rng, False) for _ in range(150)],
        "arith_zh": [arith(rng, True) for _ in range(150)],
        "capitals_en": [capital(rng, (c[0], c[1]), [x[1] for x in COUNTRIES], False) for c in COUNTRIES],
        "capitals_zh": [capital(rng, (c[2], c[3]), [x[3] for x in COUNTRIES], True) for c in COUNTRIES]
        + [capital(rng, p, [x[1] for x in PROVINCES], True, province=True) for p in PROVINCES],
    }
    gen = []
    for _ in range(50):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        gen.append({"question": f"Question: What is {a} plus {b}?\nAnswer:", "answer": str(a + b)})
    tasks["arith_gen_en"] = gen
    for name, items in tasks.items():
        with open(os.path.join(here, f"{name}.jsonl"), "w") as f:
            for it in items:
                f.write(json.dumps(it, ensure_ascii=False) + "\n")
        print(f"{name}: {len(items)} items")


if __name__ == "__main__":
    main()
