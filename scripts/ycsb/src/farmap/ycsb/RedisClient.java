package farmap.ycsb;

import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.Set;
import java.util.Vector;

import redis.clients.jedis.ClientSetInfoConfig;
import redis.clients.jedis.DefaultJedisClientConfig;
import redis.clients.jedis.Jedis;
import redis.clients.jedis.Pipeline;
import redis.clients.jedis.RedisProtocol;
import redis.clients.jedis.Response;
import redis.clients.jedis.exceptions.JedisException;
import site.ycsb.ByteArrayByteIterator;
import site.ycsb.ByteIterator;
import site.ycsb.DB;
import site.ycsb.DBException;
import site.ycsb.Status;

/**
 * YCSB binding for redis (farmap's own). One connection per instance (YCSB makes one instance
 * per client thread).
 *
 * <p>A record is a hash at its key (HSET of the fields written, HGETALL or HMGET to read).
 * Scans use one sorted set per table, {@code farmap-ycsb-index:TABLE}, whose members are the
 * keys with the key's {@link String#hashCode()} as score (exact in a double): ZADD on insert,
 * ZREM on delete, and a scan is ZRANGEBYSCORE from the start key's score, LIMIT n, followed by
 * the records' hashes. So a scan returns records in hash order, not key order, as YCSB's own
 * redis binding does.
 *
 * <p>Properties: {@code redis.host} (127.0.0.1), {@code redis.port} (6379),
 * {@code redis.timeout} (connect and socket timeout in ms, 10000).
 */
public class RedisClient extends DB {
  private static final String INDEX_PREFIX = "farmap-ycsb-index:";

  private Jedis jedis;

  @Override
  public void init() throws DBException {
    Properties p = getProperties();
    String host = p.getProperty("redis.host", "127.0.0.1");
    int port;
    int timeout;
    try {
      port = Integer.parseInt(p.getProperty("redis.port", "6379"));
      timeout = Integer.parseInt(p.getProperty("redis.timeout", "10000"));
    } catch (NumberFormatException e) {
      throw new DBException("redis.port and redis.timeout must be integers: " + e.getMessage());
    }
    DefaultJedisClientConfig config = DefaultJedisClientConfig.builder()
        .connectionTimeoutMillis(timeout)
        .socketTimeoutMillis(timeout)
        .protocol(RedisProtocol.RESP2)
        .clientSetInfoConfig(ClientSetInfoConfig.DISABLED)
        .build();
    try {
      jedis = new Jedis(host, port, config);
      String pong = jedis.ping();
      if (!"PONG".equals(pong)) {
        throw new DBException("redis at " + host + ":" + port + " answered PING with " + pong);
      }
    } catch (JedisException e) {
      throw new DBException("cannot connect to redis at " + host + ":" + port + ": " + e.getMessage(), e);
    }
  }

  @Override
  public void cleanup() throws DBException {
    if (jedis != null) {
      try {
        jedis.close();
      } catch (JedisException e) {
        throw new DBException(e);
      } finally {
        jedis = null;
      }
    }
  }

  private static byte[] bytes(String s) {
    return s.getBytes(StandardCharsets.UTF_8);
  }

  private static byte[] index(String table) {
    return bytes(INDEX_PREFIX + table);
  }

  private static double score(String key) {
    return key.hashCode();
  }

  private static Map<byte[], byte[]> encode(Map<String, ByteIterator> values) {
    Map<byte[], byte[]> m = new HashMap<>(values.size() * 2);
    for (Map.Entry<String, ByteIterator> e : values.entrySet()) {
      m.put(bytes(e.getKey()), e.getValue().toArray());
    }
    return m;
  }

  /** The fields of one hash, as HGETALL or HMGET returned them; false when the record is absent. */
  private static boolean decode(Set<String> fields, Map<byte[], byte[]> all, List<byte[]> some,
      Map<String, ByteIterator> result) {
    if (fields == null) {
      if (all == null || all.isEmpty()) {
        return false;
      }
      for (Map.Entry<byte[], byte[]> e : all.entrySet()) {
        result.put(new String(e.getKey(), StandardCharsets.UTF_8), new ByteArrayByteIterator(e.getValue()));
      }
      return true;
    }
    boolean any = false;
    int i = 0;
    for (String f : fields) {
      byte[] v = some.get(i++);
      if (v != null) {
        result.put(f, new ByteArrayByteIterator(v));
        any = true;
      }
    }
    return any || fields.isEmpty();
  }

  private static byte[][] fieldNames(Set<String> fields) {
    byte[][] names = new byte[fields.size()][];
    int i = 0;
    for (String f : fields) {
      names[i++] = bytes(f);
    }
    return names;
  }

  @Override
  public Status read(String table, String key, Set<String> fields, Map<String, ByteIterator> result) {
    try {
      boolean found;
      if (fields == null) {
        found = decode(null, jedis.hgetAll(bytes(key)), null, result);
      } else if (fields.isEmpty()) {
        found = jedis.exists(bytes(key));
      } else {
        found = decode(fields, null, jedis.hmget(bytes(key), fieldNames(fields)), result);
      }
      return found ? Status.OK : Status.NOT_FOUND;
    } catch (JedisException e) {
      return Status.ERROR;
    }
  }

  @Override
  public Status insert(String table, String key, Map<String, ByteIterator> values) {
    if (values.isEmpty()) {
      return Status.BAD_REQUEST;
    }
    try {
      Pipeline p = jedis.pipelined();
      p.hset(bytes(key), encode(values));
      p.zadd(index(table), score(key), bytes(key));
      p.sync();
      return Status.OK;
    } catch (JedisException e) {
      return Status.ERROR;
    }
  }

  @Override
  public Status update(String table, String key, Map<String, ByteIterator> values) {
    if (values.isEmpty()) {
      return Status.OK;
    }
    try {
      jedis.hset(bytes(key), encode(values));
      return Status.OK;
    } catch (JedisException e) {
      return Status.ERROR;
    }
  }

  @Override
  public Status delete(String table, String key) {
    try {
      Pipeline p = jedis.pipelined();
      Response<Long> deleted = p.del(bytes(key));
      p.zrem(index(table), bytes(key));
      p.sync();
      return deleted.get() == 1 ? Status.OK : Status.NOT_FOUND;
    } catch (JedisException e) {
      return Status.ERROR;
    }
  }

  @Override
  public Status scan(String table, String startkey, int recordcount, Set<String> fields,
      Vector<HashMap<String, ByteIterator>> result) {
    if (recordcount <= 0) {
      return Status.OK;
    }
    try {
      List<byte[]> keys = jedis.zrangeByScore(index(table), score(startkey), Double.POSITIVE_INFINITY, 0, recordcount);
      Pipeline p = jedis.pipelined();
      List<Response<Map<byte[], byte[]>>> all = new ArrayList<>();
      List<Response<List<byte[]>>> some = new ArrayList<>();
      byte[][] names = fields == null || fields.isEmpty() ? null : fieldNames(fields);
      for (byte[] k : keys) {
        if (fields == null) {
          all.add(p.hgetAll(k));
        } else if (names != null) {
          some.add(p.hmget(k, names));
        }
      }
      p.sync();
      for (int i = 0; i < keys.size(); i++) {
        HashMap<String, ByteIterator> row = new HashMap<>();
        // A key deleted between ZRANGEBYSCORE and HGETALL is left out.
        if (fields == null) {
          if (decode(null, all.get(i).get(), null, row)) {
            result.add(row);
          }
        } else if (names == null) {
          result.add(row);
        } else if (decode(fields, null, some.get(i).get(), row)) {
          result.add(row);
        }
      }
      return Status.OK;
    } catch (JedisException e) {
      return Status.ERROR;
    }
  }
}
