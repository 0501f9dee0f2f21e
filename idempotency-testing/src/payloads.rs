//! Request payloads shared by the benchmarks, so that every figure is taken over the same
//! bytes.

/// A JSON order of about 1 KiB (nine line items) whose objects have their keys out of order
/// at every depth, so a canonical fingerprint has to sort them.
pub fn order_json_1k() -> Vec<u8> {
    let items: Vec<String> = (0..9)
        .map(|i| {
            format!(
                r#"{{"z_note":"item number {i} with some text","qty":{i},"sku":"SKU-{i:05}","price":{{"currency":"EUR","amount":{}}}}}"#,
                i * 100
            )
        })
        .collect();
    format!(
        r#"{{"customer":"c_42","items":[{}],"a":true}}"#,
        items.join(",")
    )
    .into_bytes()
}
