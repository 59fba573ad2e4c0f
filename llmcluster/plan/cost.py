"""Cloud versus on-premise: the run's cloud bill, capex, monthly opex, break-even, and the phase advice.

Prices come from the dated data/prices.yaml unless the plan's `cost:` section (or its `prices:` file)
overrides them. On-premise opex = energy (average training draw x utilisation x PUE) + maintenance
(fraction of capex per year) + colocation (per provisioned kW) + staff. The cloud alternative rents the
same GPUs for the same busy hours. Break-even: the month the cumulative cloud bill passes capex + opex.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from llmcluster.plan.power import Power
from llmcluster.plan.spec import PlanSpec
from llmcluster.plan.tables import prices as price_table

HOURS_PER_MONTH = 730
SENSITIVITY_UTILISATION = (0.25, 0.5, 0.75, 1.0)
SENSITIVITY_PRICE = (0.5, 1.0, 2.0)  # x the cloud $/GPU-hour


@dataclass
class Prices:
    date: str
    cloud_usd_per_gpu_hour: float
    server_usd: float
    network_fraction: float
    power_usd_per_kwh: float
    pue: float
    maintenance_per_year: float
    colocation_usd_per_kw_month: float
    staff_usd_per_month: float
    utilisation: float
    server_life_years: float


def resolve_prices(plan: PlanSpec) -> Prices:
    table, c, gpu = price_table(plan.cost.prices), plan.cluster, plan.cluster.gpu
    values = {f.name: table.get(f.name) for f in fields(Prices)}
    values["date"] = str(table.get("date", "?"))
    values["cloud_usd_per_gpu_hour"] = table["cloud_usd_per_gpu_hour"].get(gpu)
    node = table["server_usd"].get(gpu)
    # Listed servers are 8-GPU nodes: a 4-GPU node costs half (the NICs scale with the GPUs too).
    values["server_usd"] = (node * c.gpus_per_node / 8 if node
                            else table["server_usd_per_gpu_default"] * c.gpus_per_node)
    for name, value in plan.cost.model_dump(exclude={"prices", "api_usd_per_million_tokens"}).items():
        if value is not None:
            values[name] = value
    if values["cloud_usd_per_gpu_hour"] is None:
        from llmcluster.errors import UserError
        raise UserError(f"cost.cloud_usd_per_gpu_hour: no price for {gpu} in the prices file; set it")
    return Prices(**values)


@dataclass
class Cost:
    prices: Prices
    cloud_usd: float
    onprem_capex_usd: float
    onprem_opex_usd_per_month: float
    onprem_run_usd: float          # the run's share of capex (over the server life) + its opex
    cloud_usd_per_month: float     # renting the same GPUs for the same busy hours
    break_even_months: float | None
    sensitivity: dict[float, dict[float, float | None]]
    advice: str
    serving: dict


def _break_even(capex: float, opex: float, cloud_monthly: float) -> float | None:
    return capex / (cloud_monthly - opex) if cloud_monthly > opex else None


def serving_cost(plan: PlanSpec, pw: Power, pr: Prices, capex: float) -> dict:
    """Phase 2: the same box answering requests for the plan's model, as `serve plan` lays it out (default
    `serve:` settings). Per million tokens at the decode bound of every replica busy `utilisation` of the time:
    capex over the server life, and energy at the average draw x PUE; against a cloud API's price
    (cost.api_usd_per_million_tokens). A bound on throughput makes these floors on the cost."""
    from llmcluster.config.serve import ServeConfig
    from llmcluster.plan.served_model import ServedModel
    from llmcluster.plan.serving import Box, serve_plan

    m = plan.model
    served = serve_plan(ServedModel(m.name or "model", "plan", m, m.max_seq_len, "bfloat16", None),
                        Box.from_plan(plan.cluster), ServeConfig())
    api = plan.cost.api_usd_per_million_tokens
    if "refusal" in served:
        return {"fits": False, "api_usd_per_million_tokens": api, "advice": served["refusal"]}
    tps = served["throughput"]["cluster_decode_tokens_per_s_bound"]
    busy_tokens_per_s = tps * pr.utilisation
    capex_m = capex / (pr.server_life_years * 365.25 * 86400) / busy_tokens_per_s * 1e6
    power_m = pw.avg_it_kw * pr.pue * pr.power_usd_per_kwh / (tps * 3600) * 1e6
    sv = served["serve"]
    layout = f"tp {sv['tp']} x {sv['replicas']} replicas, {sv['quantization']}, {sv['max_num_seqs']} sequences"
    if api is None:
        advice = "set cost.api_usd_per_million_tokens in the cluster spec to compare with a cloud API"
    else:
        own = capex_m + power_m
        advice = (f"{'serve on-premise' if own < api else 'use the API'}: ${own:,.3f} per million tokens "
                  f"(capex + power, at the decode bound) vs ${api:,.3f} for the API")
    return {"fits": True, "layout": layout, "tokens_per_s_bound": tps,
            "capex_usd_per_million_tokens": capex_m, "power_usd_per_million_tokens": power_m,
            "api_usd_per_million_tokens": api, "advice": advice}


def cost(plan: PlanSpec, pw: Power, gpu_hours: float, run_days: float) -> Cost:
    pr = resolve_prices(plan)
    gpus = plan.cluster.total_gpus
    capex = plan.cluster.nodes * pr.server_usd / (1 - pr.network_fraction)

    def opex(util: float) -> float:
        energy = pw.avg_it_kw * util * pr.pue * HOURS_PER_MONTH * pr.power_usd_per_kwh
        return (energy + capex * pr.maintenance_per_year / 12
                + pr.colocation_usd_per_kw_month * pw.it_kw + pr.staff_usd_per_month)

    def cloud_monthly(util: float, price: float) -> float:
        return gpus * HOURS_PER_MONTH * util * price

    u, price = pr.utilisation, pr.cloud_usd_per_gpu_hour
    monthly = opex(u)
    cloud_m = cloud_monthly(u, price)
    run_months = run_days * 24 / HOURS_PER_MONTH
    onprem_run = (capex / (pr.server_life_years * 12) + monthly) * run_months / u
    sensitivity = {util: {k: _break_even(capex, opex(util), cloud_monthly(util, price * k))
                          for k in SENSITIVITY_PRICE} for util in SENSITIVITY_UTILISATION}
    year_cloud, year_onprem = 12 * cloud_m, capex + 12 * monthly
    verdict = ("move training on-premise" if year_cloud > year_onprem else "stay on the cloud")
    advice = (f"{verdict}: 12 months of cloud at {u:.0%} utilisation cost ${year_cloud:,.0f} "
              f"({gpus} x {plan.cluster.gpu} at ${price:.2f}/GPU-h) vs ${year_onprem:,.0f} on-premise "
              f"(capex ${capex:,.0f} + 12 x ${monthly:,.0f} opex)")
    return Cost(prices=pr, cloud_usd=gpu_hours * price, onprem_capex_usd=capex, onprem_opex_usd_per_month=monthly,
                onprem_run_usd=onprem_run, cloud_usd_per_month=cloud_m,
                break_even_months=_break_even(capex, monthly, cloud_m), sensitivity=sensitivity, advice=advice,
                serving=serving_cost(plan, pw, pr, capex))
